//! The one table from architecture names to loaders.

use cellm_format::{CellmFile, Error, Result};

use crate::{deepseek, gemma, lfm2, llama, qwen35, CausalLm, ModelConfig};

type Loader = fn(&CellmFile, ModelConfig) -> Result<Box<dyn CausalLm>>;

const FAMILIES: &[(&str, Loader)] = &[
    ("llama", llama::load),
    ("gemma3", gemma::load),
    ("lfm2", lfm2::load),
    ("qwen3_5", qwen35::load),
    ("deepseek_v3", deepseek::load),
];

pub const SUPPORTED_ARCHITECTURES: &[&str] = &["llama", "gemma3", "lfm2", "qwen3_5", "deepseek_v3"];

/// Builds the model a validated file describes.
pub fn load(file: &CellmFile) -> Result<Box<dyn CausalLm>> {
    let config = ModelConfig::from_json(&file.header().model)?;
    let (_, loader) =
        FAMILIES.iter().find(|(name, _)| *name == config.architecture).ok_or_else(|| {
            Error::Unsupported(format!(
                "architecture '{}' is not supported (supported: {})",
                config.architecture,
                SUPPORTED_ARCHITECTURES.join(", ")
            ))
        })?;
    loader(file, config)
}
