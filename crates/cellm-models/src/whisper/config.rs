//! The description's `whisper` section: the audio encoder's shape. The decoder is described
//! by the common fields (`hidden_size`, `num_layers`, `num_heads`, `intermediate_size`, and
//! `max_position_embeddings` for its learned position table).

use cellm_format::Result;
use serde::Deserialize;

use crate::config::{bad_field, check_dim, check_product, check_state, Section};
use crate::ModelConfig;

/// The most encoder positions a description may declare (Whisper's is 1500, 30 s): the
/// cross-attention memory of one session is `2 * layers * positions * hidden` floats.
const MAX_SOURCE_POSITIONS: usize = 1 << 16;

#[derive(Debug, Clone, Deserialize)]
pub struct WhisperConfig {
    pub num_mel_bins: usize,
    pub encoder_layers: usize,
    pub encoder_heads: usize,
    pub encoder_ffn_dim: usize,
    /// Encoder positions: the input's frames halved by the second convolution's stride.
    pub source_positions: usize,
}

impl WhisperConfig {
    /// Log-mel frames of one window.
    pub fn frames(&self) -> usize {
        2 * self.source_positions
    }
}

impl Section for WhisperConfig {
    const NAME: &'static str = "whisper";

    fn check(&self, model: &ModelConfig) -> Result<()> {
        check_dim("whisper.num_mel_bins", self.num_mel_bins)?;
        check_dim("whisper.encoder_layers", self.encoder_layers)?;
        check_dim("whisper.encoder_heads", self.encoder_heads)?;
        check_dim("whisper.encoder_ffn_dim", self.encoder_ffn_dim)?;
        check_dim("whisper.source_positions", self.source_positions)?;
        if self.source_positions > MAX_SOURCE_POSITIONS {
            return Err(bad_field(
                "whisper.source_positions",
                format_args!("is {} (at most {MAX_SOURCE_POSITIONS})", self.source_positions),
            ));
        }
        let d = model.hidden_size;
        if !d.is_multiple_of(self.encoder_heads) {
            return Err(bad_field(
                "whisper.encoder_heads",
                format_args!("{} does not divide hidden_size {d}", self.encoder_heads),
            ));
        }
        if model.num_heads * model.head_dim != d || model.num_kv_heads != model.num_heads {
            return Err(bad_field(
                "num_heads",
                format_args!(
                    "* head_dim must be hidden_size {d}, with as many kv heads (Whisper's \
                     decoder attention)"
                ),
            ));
        }
        check_product("whisper.num_mel_bins", &[3, self.num_mel_bins])?;
        // One window's second convolution input, unfolded: frames x 3 taps x hidden.
        check_product("whisper.source_positions", &[2, self.source_positions, 3, d])?;
        check_state("whisper.source_positions", &[2, self.source_positions, d])?;
        Ok(())
    }
}
