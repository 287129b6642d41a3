//! The one table from architecture names to loaders. Everything that lists architectures
//! (error messages, the converter's `cellm._core.architectures()`) reads it.

use cellm_format::{CellmFile, Error, Result};

use crate::weights::{TensorSpec, Weights};
use crate::{deepseek, gemma, lfm2, llama, qwen35, CausalLm, ModelConfig};

type Loader = fn(&Weights, ModelConfig) -> Result<Box<dyn CausalLm>>;

const FAMILIES: &[(&str, Loader)] = &[
    ("llama", llama::load),
    ("gemma3", gemma::load),
    ("lfm2", lfm2::load),
    ("qwen3_5", qwen35::load),
    ("deepseek_v3", deepseek::load),
];

/// The architecture names the engine runs, in registry order.
pub fn architectures() -> impl Iterator<Item = &'static str> {
    FAMILIES.iter().map(|(name, _)| *name)
}

/// Builds the model a validated file describes.
pub fn load(file: &CellmFile) -> Result<Box<dyn CausalLm>> {
    let config = ModelConfig::from_json(&file.header().model)?;
    build(&Weights::from_file(file), config)
}

/// Every tensor the model that `model` (a file's `model` section) describes would read, in the
/// order its loader asks for them: the converter's plan.
pub fn expected_tensors(model: &serde_json::Value) -> Result<Vec<TensorSpec>> {
    let weights = Weights::planner();
    build(&weights, ModelConfig::from_json(model)?)?;
    Ok(weights.into_specs())
}

fn build(weights: &Weights, config: ModelConfig) -> Result<Box<dyn CausalLm>> {
    let (_, loader) =
        FAMILIES.iter().find(|(name, _)| *name == config.architecture).ok_or_else(|| {
            Error::Unsupported(format!(
                "architecture '{}' is not supported (supported: {})",
                config.architecture,
                architectures().collect::<Vec<_>>().join(", ")
            ))
        })?;
    loader(weights, config)
}
