"""Image preprocessing for the vision-language families, in pillow and numpy: images in
every form the API takes become the patches the engine's vision tower reads and the text
that stands for them in the prompt."""

from .idefics3 import Idefics3Images
from .images import ImageInput, load_rgb
from .lfm2_vl import Lfm2VlImages
from .processed import ProcessedImage

__all__ = ["Idefics3Images", "ImageInput", "Lfm2VlImages", "ProcessedImage", "load_rgb"]
