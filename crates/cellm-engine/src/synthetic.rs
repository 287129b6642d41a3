//! Small model files made up from a description, for tests and fuzzing, where the converter
//! (Python) is not at hand: every tensor the model reads ([`cellm_models::expected_tensors`])
//! in f32, with made-up deterministic values (norm weights near 1, the rest small), so
//! logits are finite and differ between positions.

use cellm_format::{Result, FORMAT_VERSION, MAGIC};
use serde_json::{json, Value};

/// Tensors and the data section start at multiples of this (`docs/format.md`).
const ALIGN: usize = 64;

/// A `.cellm` file (as bytes) of the model `model` describes, its values drawn from `seed`.
pub fn model_file(model: &Value, seed: u64) -> Result<Vec<u8>> {
    let specs = cellm_models::expected_tensors(model)?;
    let mut data: Vec<u8> = Vec::new();
    let mut table = Vec::with_capacity(specs.len());
    for (i, spec) in specs.iter().enumerate() {
        let numel: usize = spec.shape.iter().product();
        let cols = spec.shape.last().copied().unwrap_or(1).max(1);
        let norm = spec.shape.len() == 1 && spec.name.contains("norm");
        let offset = data.len();
        for j in 0..numel {
            let u = unit(seed ^ (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15), j as u64);
            let v = if norm { 1.0 + 0.1 * u } else { u / (cols as f32).sqrt() };
            data.extend_from_slice(&v.to_le_bytes());
        }
        table.push(json!({"name": spec.name, "format": "f32", "shape": spec.shape,
            "offset": offset, "nbytes": numel * 4}));
        data.resize(data.len().next_multiple_of(ALIGN), 0);
    }
    let header = json!({"format_version": FORMAT_VERSION, "model": model, "tensors": table,
        "data_size": data.len()})
    .to_string();
    let mut file = MAGIC.to_vec();
    file.extend_from_slice(&[FORMAT_VERSION, 0, 0]);
    file.extend_from_slice(&(header.len() as u64).to_le_bytes());
    file.extend_from_slice(header.as_bytes());
    file.resize(file.len().next_multiple_of(ALIGN), 0);
    file.extend_from_slice(&data);
    Ok(file)
}

/// A value in [-1, 1) from a seed and an index (splitmix64).
fn unit(seed: u64, i: u64) -> f32 {
    let mut z = seed.wrapping_add(i.wrapping_mul(0x9E37_79B9_7F4A_7C15));
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    (z >> 40) as f32 / (1u64 << 23) as f32 - 1.0
}

/// One tiny description per family the registry runs (the shapes of the test fixtures in
/// `tests/fixtures/hf-tiny`, with fewer layers): `(architecture, model)`.
pub fn tiny_models() -> Vec<(&'static str, Value)> {
    let base = json!({
        "architecture": "llama", "model_type": "llama", "vocab_size": 64, "hidden_size": 32,
        "intermediate_size": 48, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
        "head_dim": 8, "norm_eps": 1e-5, "max_position_embeddings": 512,
        "tie_word_embeddings": true, "rope": {"inv_freq": [1.0, 0.1, 0.01, 0.001]},
    });
    let with = |edits: Value| {
        let mut m = base.clone();
        for (k, v) in edits.as_object().expect("an object") {
            m[k] = v.clone();
        }
        m
    };
    vec![
        ("llama", base.clone()),
        (
            "gemma3",
            with(json!({"architecture": "gemma3", "qk_norm": true, "hidden_act": "gelu_tanh",
                "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 5,
                "embedding_multiplier": 5.6, "final_logit_softcap": 30.0,
                "rope_local": {"inv_freq": [1.0, 0.5, 0.25, 0.125]}})),
        ),
        (
            "lfm2",
            with(json!({"architecture": "lfm2", "qk_norm": true, "num_layers": 3,
                "layer_types": ["conv", "full_attention", "conv"], "conv": {"taps": 3}})),
        ),
        (
            "qwen3_5",
            with(json!({"architecture": "qwen3_5", "qk_norm": true, "attn_output_gate": true,
                "layer_types": ["linear_attention", "full_attention"],
                "linear_attention": {"conv_taps": 4, "k_heads": 2, "v_heads": 4, "k_dim": 8,
                    "v_dim": 8}})),
        ),
        (
            "deepseek_v3",
            with(json!({"architecture": "deepseek_v3", "head_dim": 12, "num_kv_heads": 4,
                "tie_word_embeddings": false, "rope": {"inv_freq": [1.0, 0.1]},
                "mla": {"q_lora_rank": 16, "kv_lora_rank": 8, "nope_dim": 8, "rope_dim": 4,
                    "v_dim": 8},
                "moe": {"experts": 4, "experts_per_token": 2, "groups": 2,
                    "groups_per_token": 1, "norm_topk_prob": true,
                    "routed_scaling_factor": 2.5, "shared_experts": 1,
                    "expert_intermediate_size": 16, "first_moe_layer": 1}})),
        ),
        (
            "whisper",
            with(json!({"architecture": "whisper", "model_type": "whisper", "num_kv_heads": 4,
                "max_position_embeddings": 64, "rope": {"inv_freq": []}, "hidden_act": "gelu",
                "whisper": {"num_mel_bins": 8, "encoder_layers": 1, "encoder_heads": 2,
                    "encoder_ffn_dim": 48, "source_positions": 6}})),
        ),
    ]
}
