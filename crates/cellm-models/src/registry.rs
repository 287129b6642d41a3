//! The one table from architecture names to loaders. Everything that lists architectures
//! (error messages, the converter's `cellm._core.architectures()`) reads it.

use cellm_format::{CellmFile, Error, Result};

use crate::encoder::{self, Encoder, EncoderLoader};
use crate::weights::{TensorSpec, Weights};
use crate::{
    deepseek, gemma, gemma4, granite_hybrid, lfm2, llama, qwen35, vision, whisper, CausalLm,
    ModelConfig,
};

type Loader = fn(&Weights, ModelConfig) -> Result<Box<dyn CausalLm>>;

const FAMILIES: &[(&str, Loader)] = &[
    ("llama", llama::load),
    ("gemma3", gemma::load),
    ("gemma4", gemma4::load),
    ("lfm2", lfm2::load),
    ("qwen3_5", qwen35::load),
    ("granitemoehybrid", granite_hybrid::load),
    ("deepseek_v3", deepseek::load),
    ("idefics3", vision::load_idefics3),
    ("lfm2_vl", vision::load_lfm2_vl),
    ("whisper", whisper::load),
];

/// Encoders: models that give one row per token of a whole text rather than generate.
const ENCODERS: &[(&str, EncoderLoader)] =
    &[("openai_privacy_filter", encoder::load_privacy_filter), ("bert", encoder::load_bert)];

/// The architecture names the engine runs, in registry order: language models, then encoders.
pub fn architectures() -> impl Iterator<Item = &'static str> {
    FAMILIES.iter().map(|(name, _)| *name).chain(ENCODERS.iter().map(|(name, _)| *name))
}

/// Builds the model a validated file describes.
pub fn load(file: &CellmFile) -> Result<Box<dyn CausalLm>> {
    load_limited(file, None)
}

/// As [`load`], the model's forward running only its first `max_layers` layers (then the
/// final norm and the head): a debugging aid. The caches stay sized for every layer.
pub fn load_limited(file: &CellmFile, max_layers: Option<usize>) -> Result<Box<dyn CausalLm>> {
    let model = &file.header().model;
    if let Some((name, _)) = encoder_of(model) {
        return Err(Error::Unsupported(format!(
            "'{name}' is an encoder, not a language model: it has no text to generate (use \
             cellm.PrivacyFilter or cellm.Embedder)"
        )));
    }
    let mut config = ModelConfig::from_json(model)?;
    if let Some(n) = max_layers {
        if n == 0 || n > config.num_layers {
            return Err(Error::InvalidArgument(format!(
                "max_layers must be 1 to {} (the model's layers), not {n}",
                config.num_layers
            )));
        }
        config.max_layers = Some(n);
    }
    build(&Weights::from_file(file), config)
}

/// Builds the encoder a file describes.
pub fn load_encoder(file: &CellmFile) -> Result<Box<dyn Encoder>> {
    let model = &file.header().model;
    let Some((_, loader)) = encoder_of(model) else {
        return Err(Error::Unsupported(format!(
            "architecture {} is not an encoder (encoders: {})",
            model.get("architecture").map_or("none".to_string(), |a| a.to_string()),
            ENCODERS.iter().map(|(n, _)| *n).collect::<Vec<_>>().join(", ")
        )));
    };
    loader(&Weights::from_file(file), model)
}

/// Every tensor the model that `model` (a file's `model` section) describes would read, in the
/// order its loader asks for them: the converter's plan.
pub fn expected_tensors(model: &serde_json::Value) -> Result<Vec<TensorSpec>> {
    let weights = Weights::planner();
    match encoder_of(model) {
        Some((_, loader)) => {
            loader(&weights, model)?;
        }
        None => {
            build(&weights, ModelConfig::from_json(model)?)?;
        }
    }
    Ok(weights.into_specs())
}

/// The encoder architecture `model` names and its loader, if it names one.
fn encoder_of(model: &serde_json::Value) -> Option<(&'static str, EncoderLoader)> {
    let arch = model.get("architecture")?.as_str()?;
    ENCODERS.iter().copied().find(|(n, _)| *n == arch)
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

#[cfg(test)]
mod tests {
    use serde_json::{json, Value};

    use super::*;
    use crate::config::tests::{llama, with};

    fn lfm2() -> Value {
        let layers = json!(["conv", "full_attention", "conv", "conv"]);
        let edits = json!({"architecture": "lfm2", "layer_types": layers, "qk_norm": true});
        with(with(llama(), edits), json!({"conv": {"taps": 3}}))
    }

    fn qwen35() -> Value {
        let layers =
            json!(["linear_attention", "linear_attention", "linear_attention", "full_attention"]);
        let delta = json!({"conv_taps": 4, "k_heads": 2, "v_heads": 4, "k_dim": 16, "v_dim": 16});
        let edits = json!({"architecture": "qwen3_5", "layer_types": layers,
            "attn_output_gate": true, "qk_norm": true, "linear_attention": delta});
        with(llama(), edits)
    }

    fn deepseek() -> Value {
        let mla = json!({"q_lora_rank": 48, "kv_lora_rank": 32, "nope_dim": 16, "rope_dim": 8,
            "v_dim": 16});
        let moe = json!({"experts": 8, "experts_per_token": 2, "groups": 2,
            "groups_per_token": 1, "norm_topk_prob": true, "routed_scaling_factor": 2.5,
            "shared_experts": 1, "expert_intermediate_size": 32, "first_moe_layer": 1});
        let edits = json!({"architecture": "deepseek_v3", "head_dim": 24, "num_kv_heads": 4,
            "rope": {"inv_freq": [1.0, 0.1, 0.01, 0.001]}, "mla": mla, "moe": moe});
        with(llama(), edits)
    }

    /// Gemma 4: two sliding layers (heads 16 wide) around a full one (32 wide); the last
    /// layer reads the first's cache.
    fn gemma4() -> Value {
        let layers = json!(["sliding_attention", "full_attention", "sliding_attention"]);
        let g = json!({"head_dims": [16, 32, 16], "mlp_widths": [160, 160, 320],
            "kv_from": [null, null, 0], "per_layer_input": {"width": 8, "embed_scale": 2.8}});
        let edits = json!({"architecture": "gemma4", "num_layers": 3, "head_dim": 32,
            "layer_types": layers, "sliding_window": 4, "gemma4": g,
            "rope": {"inv_freq": vec![0.5; 16]}, "rope_local": {"inv_freq": vec![0.5; 8]}});
        with(llama(), edits)
    }

    /// Granite 4.0-H: Mamba-2 layers around an attention layer.
    fn granite() -> Value {
        let layers =
            json!(["linear_attention", "full_attention", "linear_attention", "linear_attention"]);
        let mamba = json!({"heads": 8, "head_dim": 16, "state": 16, "groups": 2, "conv_taps": 4,
            "conv_bias": true});
        with(
            llama(),
            json!({"architecture": "granitemoehybrid", "layer_types": layers, "mamba": mamba}),
        )
    }

    /// `model` with `section.field` set to `value`.
    fn edit(mut model: Value, section: &str, field: &str, value: Value) -> Value {
        model[section][field] = value;
        model
    }

    fn refusal(model: &Value) -> String {
        match expected_tensors(model) {
            Err(Error::Format(m)) => m,
            other => panic!("expected a format error, got {other:?}"),
        }
    }

    /// Family sections are checked when read, by field name, before any tensor is asked for.
    #[test]
    fn family_sections_are_checked() {
        for model in [lfm2(), qwen35(), deepseek(), gemma4(), granite()] {
            expected_tensors(&model).unwrap();
        }
        let huge = json!(1usize << 20);
        for (model, needle) in [
            // Used to end in "capacity overflow" (taps - 1 wrapped).
            (edit(lfm2(), "conv", "taps", json!(0)), "conv.taps is 0"),
            (edit(qwen35(), "linear_attention", "conv_taps", json!(0)), "conv_taps is 0"),
            (edit(qwen35(), "linear_attention", "k_dim", json!(0)), "k_dim is 0"),
            (edit(qwen35(), "linear_attention", "v_heads", json!(3)), "v_heads 3 cannot share"),
            (
                edit(
                    edit(qwen35(), "linear_attention", "k_dim", huge.clone()),
                    "linear_attention",
                    "v_dim",
                    huge,
                ),
                "v_heads * k_dim * v_dim makes a session state of 4 * 1048576 * 1048576 floats",
            ),
            (edit(deepseek(), "mla", "rope_dim", json!(0)), "mla.rope_dim is 0"),
            (edit(granite(), "mamba", "groups", json!(3)), "mamba.heads 8 cannot share 3"),
            (edit(granite(), "mamba", "state", json!(0)), "mamba.state is 0"),
            (edit(granite(), "mamba", "conv_taps", json!(0)), "mamba.conv_taps is 0"),
            (edit(granite(), "mamba", "dt_max", json!(-1.0)), "dt_max must be finite"),
            (edit(gemma4(), "gemma4", "kv_from", json!([null, null, 1])), "kv_from[2] is 1"),
            (edit(gemma4(), "gemma4", "kv_from", json!([2, null, null])), "kv_from[0] is 2"),
            (edit(gemma4(), "gemma4", "head_dims", json!([16, 64, 16])), "head_dims[1] is 64"),
            (edit(gemma4(), "gemma4", "head_dims", json!([16, 16, 16])), "RoPE turns 32"),
            (edit(gemma4(), "gemma4", "mlp_widths", json!([1])), "has 1 entries for 3"),
            (edit(deepseek(), "mla", "q_lora_rank", json!(0)), "mla.q_lora_rank is 0"),
            (edit(deepseek(), "moe", "groups", json!(3)), "moe.groups 3 do not split 8"),
            (edit(deepseek(), "moe", "groups", json!(0)), "moe.groups is 0"),
            (edit(deepseek(), "moe", "experts_per_token", json!(5)), "experts_per_token is 5"),
            (edit(deepseek(), "moe", "groups_per_token", json!(3)), "groups_per_token is 3"),
            (edit(deepseek(), "moe", "routed_scaling_factor", json!(-1.0)), "routed_scaling"),
        ] {
            let message = refusal(&model);
            assert!(message.starts_with("bad model description: "), "{message}");
            assert!(message.contains(needle), "{needle}: {message}");
        }
    }

    /// DeepSeek's RoPE turns rope_dim dims; more frequencies used to slice out of range at the
    /// first forward.
    #[test]
    fn mla_rope_must_fit_its_rope_dim() {
        let mut model = deepseek();
        model["rope"]["inv_freq"] = json!([1.0, 0.5, 0.25, 0.125, 0.0625]);
        let message = refusal(&model);
        assert!(
            message.contains("rope.inv_freq has 5 frequencies: 10 rotary dims > mla.rope_dim 8"),
            "{message}"
        );
    }
}
