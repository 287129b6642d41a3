//! The description's `vision` section: the tower's shape and the connector that maps its
//! patches to the language model's embedding rows.

use cellm_format::Result;
use serde::Deserialize;

use crate::config::{bad_field, check_dim, check_positive, check_product, Section};
use crate::ModelConfig;

/// Which connector, and with it the tower's position scheme.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ConnectorKind {
    /// SmolVLM: a fixed position grid bucketed per tile; pixel shuffle, then one linear.
    Idefics3,
    /// LFM2-VL: SigLIP2 NaFlex's position grid resized per image; pixel unshuffle, then
    /// LayerNorm and a two-layer MLP with exact gelu.
    Lfm2Vl,
}

#[derive(Debug, Clone, Deserialize)]
pub struct VisionConfig {
    pub connector: ConnectorKind,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub patch_size: usize,
    /// Entries of the learned position table, a square grid.
    pub num_positions: usize,
    pub norm_eps: f32,
    /// Patches per side merged into one token (`scale_factor`, `downsample_factor`).
    pub scale_factor: usize,
    pub image_token_id: u32,
    /// LFM2-VL's projector.
    #[serde(default)]
    pub projector_hidden_size: usize,
    #[serde(default = "yes")]
    pub projector_bias: bool,
    #[serde(default = "yes")]
    pub projector_layernorm: bool,
}

fn yes() -> bool {
    true
}

impl VisionConfig {
    pub fn head_dim(&self) -> usize {
        self.hidden_size / self.num_heads
    }

    /// Side of the position grid.
    pub fn grid_side(&self) -> usize {
        (self.num_positions as f64).sqrt().round() as usize
    }

    /// Width of one patch row: its pixels, 3 channels.
    pub fn patch_dim(&self) -> usize {
        3 * self.patch_size * self.patch_size
    }

    /// Width of a merged token, before the connector's projection.
    pub fn merged_dim(&self) -> usize {
        self.hidden_size * self.scale_factor * self.scale_factor
    }
}

impl Section for VisionConfig {
    const NAME: &'static str = "vision";

    fn check(&self, model: &ModelConfig) -> Result<()> {
        check_dim("vision.hidden_size", self.hidden_size)?;
        check_dim("vision.intermediate_size", self.intermediate_size)?;
        check_dim("vision.num_layers", self.num_layers)?;
        check_dim("vision.num_heads", self.num_heads)?;
        check_dim("vision.patch_size", self.patch_size)?;
        check_dim("vision.num_positions", self.num_positions)?;
        check_dim("vision.scale_factor", self.scale_factor)?;
        check_positive("vision.norm_eps", self.norm_eps)?;
        if !self.hidden_size.is_multiple_of(self.num_heads) {
            return Err(bad_field(
                "vision.num_heads",
                format_args!("{} does not divide hidden_size {}", self.num_heads, self.hidden_size),
            ));
        }
        let side = self.grid_side();
        if side * side != self.num_positions {
            return Err(bad_field("vision.num_positions", "is not a square grid"));
        }
        check_product("vision.patch_size", &[3, self.patch_size, self.patch_size])?;
        check_product(
            "vision.scale_factor",
            &[self.hidden_size, self.scale_factor, self.scale_factor],
        )?;
        if self.connector == ConnectorKind::Lfm2Vl {
            check_dim("vision.projector_hidden_size", self.projector_hidden_size)?;
        }
        if self.image_token_id as usize >= model.vocab_size {
            return Err(bad_field(
                "vision.image_token_id",
                format_args!(
                    "{} is outside the vocabulary ({})",
                    self.image_token_id, model.vocab_size
                ),
            ));
        }
        Ok(())
    }
}
