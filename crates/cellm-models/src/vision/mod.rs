//! Vision-language models: a SigLIP-family tower and a connector turn an image's tiles into
//! embedding rows, which the engine places at the prompt's image tokens of an ordinary text
//! model (llama for Idefics3, LFM2 for LFM2-VL). Images arrive preprocessed, as patch rows
//! (`python/cellm/vision`).

mod config;
mod connector;
mod positions;
mod siglip;

use cellm_format::{Error, Result};
use cellm_kv::{PagePool, SeqState};

pub use config::{ConnectorKind, VisionConfig};

use crate::weights::Weights;
use crate::{lfm2, llama, CacheLayout, CausalLm, ForwardError, ModelConfig, Step};
use connector::{merge_blocks, Connector};
use siglip::Tower;

/// The tower and the connector: tiles of patches in, embedding rows out.
pub struct VisionEncoder {
    pub config: VisionConfig,
    tower: Tower,
    connector: Connector,
}

impl VisionEncoder {
    pub fn load(w: &Weights, model: &ModelConfig) -> Result<Self> {
        let config: VisionConfig = model.section()?;
        let tower = Tower::load(w, &config)?;
        let connector = Connector::load(w, &config, model.hidden_size)?;
        Ok(Self { config, tower, connector })
    }

    /// Image tokens a tile of `rows x cols` patches becomes.
    pub fn tokens(&self, rows: usize, cols: usize) -> usize {
        let s = self.config.scale_factor;
        (rows / s) * (cols / s)
    }

    /// Embedding rows (`tokens x text hidden`) of tiles given as patch rows (each
    /// `3 * patch * patch` wide, (y, x, channel) order), tile after tile; `grids[i]` is tile
    /// i's patch grid, whose sides the merge factor must divide.
    pub fn encode(&self, patches: &[f32], grids: &[(usize, usize)]) -> Result<Vec<f32>> {
        let c = &self.config;
        let s = c.scale_factor;
        let mut n = 0usize;
        for &(rows, cols) in grids {
            if rows == 0 || cols == 0 || rows % s != 0 || cols % s != 0 {
                return Err(Error::InvalidArgument(format!(
                    "a tile of {rows}x{cols} patches: each side must be a positive multiple of {s}"
                )));
            }
            n = rows
                .checked_mul(cols)
                .and_then(|t| n.checked_add(t))
                .ok_or_else(|| Error::InvalidArgument("too many patches".into()))?;
        }
        if Some(patches.len()) != n.checked_mul(c.patch_dim()) {
            return Err(Error::InvalidArgument(format!(
                "{} patch values for {n} patches of {} values",
                patches.len(),
                c.patch_dim()
            )));
        }
        let hidden = self.tower.forward(patches, grids);
        let mut merged = Vec::with_capacity(hidden.len());
        let mut at = 0;
        for &(rows, cols) in grids {
            let tile = &hidden[at * c.hidden_size..(at + rows * cols) * c.hidden_size];
            merged.extend(merge_blocks(tile, rows, cols, c.hidden_size, s));
            at += rows * cols;
        }
        let tokens = n / (s * s);
        Ok(self.connector.project(merged, tokens))
    }
}

/// A text model with a vision encoder beside it; steps go to the text model unchanged.
struct Multimodal {
    text: Box<dyn CausalLm>,
    vision: VisionEncoder,
}

impl CausalLm for Multimodal {
    fn config(&self) -> &ModelConfig {
        self.text.config()
    }

    fn cache_layout(&self) -> CacheLayout {
        self.text.cache_layout()
    }

    fn forward(
        &self,
        step: &Step,
        kv: &mut PagePool,
        states: &mut [&mut SeqState],
    ) -> std::result::Result<Vec<f32>, ForwardError> {
        self.text.forward(step, kv, states)
    }

    fn vision(&self) -> Option<&VisionEncoder> {
        Some(&self.vision)
    }
}

type TextLoader = fn(&Weights, ModelConfig) -> Result<Box<dyn CausalLm>>;

fn load_with(w: &Weights, cfg: ModelConfig, text: TextLoader) -> Result<Box<dyn CausalLm>> {
    let vision = VisionEncoder::load(w, &cfg)?;
    Ok(Box::new(Multimodal { text: text(w, cfg)?, vision }))
}

/// SmolVLM: a llama-like text model.
pub fn load_idefics3(w: &Weights, cfg: ModelConfig) -> Result<Box<dyn CausalLm>> {
    load_with(w, cfg, llama::load)
}

/// LFM2-VL: an LFM2 text model.
pub fn load_lfm2_vl(w: &Weights, cfg: ModelConfig) -> Result<Box<dyn CausalLm>> {
    load_with(w, cfg, lfm2::load)
}
