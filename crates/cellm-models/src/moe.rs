//! Mixture of experts with DeepSeek-V3's router: sigmoid scores, a per-expert correction bias
//! used only for choosing, experts chosen within the best groups (a group scores the sum of
//! its two best), weights renormalised over the chosen and scaled; plus always-on shared
//! experts.

use cellm_format::{Result, Tensor};
use cellm_kernels::{matmul, ops};
use serde::Deserialize;

use crate::blocks::{gather_rows, GatedMlp};
use crate::config::{check_at_most, check_dim, check_positive, check_product, Section};
use crate::weights::{Storage, Weights};
use crate::{Activation, ModelConfig};

/// The description's `moe` section.
#[derive(Debug, Clone, Deserialize)]
pub struct MoeConfig {
    pub experts: usize,
    pub experts_per_token: usize,
    pub groups: usize,
    pub groups_per_token: usize,
    pub norm_topk_prob: bool,
    pub routed_scaling_factor: f32,
    pub shared_experts: usize,
    pub expert_intermediate_size: usize,
    /// Layers before this one use a dense MLP.
    pub first_moe_layer: usize,
}

impl Section for MoeConfig {
    const NAME: &'static str = "moe";

    fn check(&self, _model: &ModelConfig) -> Result<()> {
        let experts = check_dim("moe.experts", self.experts)?;
        let groups = check_dim("moe.groups", self.groups)?;
        if !experts.is_multiple_of(groups) {
            return Err(crate::config::bad_field(
                "moe.groups",
                format_args!("{groups} do not split {experts} experts evenly"),
            ));
        }
        check_dim("moe.groups_per_token", self.groups_per_token)?;
        check_at_most("moe.groups_per_token", self.groups_per_token, "moe.groups", groups)?;
        check_dim("moe.experts_per_token", self.experts_per_token)?;
        let reachable = self.groups_per_token * (experts / groups);
        check_at_most(
            "moe.experts_per_token",
            self.experts_per_token,
            "the experts of groups_per_token groups",
            reachable,
        )?;
        check_positive("moe.routed_scaling_factor", self.routed_scaling_factor)?;
        let inter = check_dim("moe.expert_intermediate_size", self.expert_intermediate_size)?;
        if self.shared_experts > 0 {
            check_product(
                "moe.shared_experts * expert_intermediate_size",
                &[self.shared_experts, inter],
            )?;
        }
        Ok(())
    }
}

pub struct Moe {
    router: Tensor,
    correction: Vec<f32>,
    experts: Vec<GatedMlp>,
    shared: Option<GatedMlp>,
    cfg: MoeConfig,
}

impl Moe {
    /// HF's layout (`cfg` checked by [`Section::check`]): `{p}.gate.weight` (f32), `{p}.gate.e_score_correction_bias`,
    /// `{p}.experts.{e}.*_proj`, `{p}.shared_experts.*_proj`.
    pub fn load(
        w: &Weights,
        p: &str,
        cfg: &MoeConfig,
        hidden: usize,
        act: Activation,
    ) -> Result<Self> {
        let router = w.get(&format!("{p}.gate.weight"), &[cfg.experts, hidden], Storage::F32)?;
        let correction =
            w.vector(&format!("{p}.gate.e_score_correction_bias"), cfg.experts)?.as_f32()?.to_vec();
        let inter = cfg.expert_intermediate_size;
        let experts = (0..cfg.experts)
            .map(|e| GatedMlp::load(w, &format!("{p}.experts.{e}"), hidden, inter, false, act))
            .collect::<Result<Vec<_>>>()?;
        let shared = (cfg.shared_experts > 0)
            .then(|| {
                let inter = inter * cfg.shared_experts;
                GatedMlp::load(w, &format!("{p}.shared_experts"), hidden, inter, false, act)
            })
            .transpose()?;
        Ok(Self { router, correction, experts, shared, cfg: cfg.clone() })
    }

    /// `rows x hidden` in, `rows x hidden` out.
    pub fn forward(&self, x: &[f32], rows: usize) -> Vec<f32> {
        let hidden = x.len() / rows.max(1);
        let mut logits = vec![0.0; rows * self.cfg.experts];
        matmul(x, rows, &self.router, &mut logits);
        // Per expert, the rows routed to it and their weights.
        let mut routed: Vec<(Vec<usize>, Vec<f32>)> =
            vec![(Vec::new(), Vec::new()); self.experts.len()];
        for (r, row) in logits.chunks_exact(self.cfg.experts).enumerate() {
            for (e, weight) in self.route(row) {
                routed[e].0.push(r);
                routed[e].1.push(weight);
            }
        }
        let mut out = match &self.shared {
            Some(shared) => shared.forward(x, rows),
            None => vec![0.0; rows * hidden],
        };
        for (expert, (ids, weights)) in self.experts.iter().zip(&routed) {
            if ids.is_empty() {
                continue;
            }
            let y = expert.forward(&gather_rows(x, hidden, ids), ids.len());
            for ((&r, &wgt), yr) in ids.iter().zip(weights).zip(y.chunks_exact(hidden)) {
                ops::add_scaled(&mut out[r * hidden..(r + 1) * hidden], yr, wgt);
            }
        }
        out
    }

    /// The chosen experts of one token and their weights.
    fn route(&self, logits: &[f32]) -> Vec<(usize, f32)> {
        let c = &self.cfg;
        let scores: Vec<f32> = logits.iter().map(|l| 1.0 / (1.0 + (-l).exp())).collect();
        let choice: Vec<f32> = scores.iter().zip(&self.correction).map(|(s, b)| s + b).collect();
        let per_group = c.experts / c.groups;
        let group_score = |g: usize| {
            let mut top = choice[g * per_group..(g + 1) * per_group].to_vec();
            top.sort_unstable_by(|a, b| b.total_cmp(a));
            top.iter().take(2).sum::<f32>()
        };
        let groups =
            top_indices(&(0..c.groups).map(group_score).collect::<Vec<_>>(), c.groups_per_token);
        let masked: Vec<f32> = (0..c.experts)
            .map(|e| if groups.contains(&(e / per_group)) { choice[e] } else { f32::NEG_INFINITY })
            .collect();
        let chosen = top_indices(&masked, c.experts_per_token);
        let mut weights: Vec<f32> = chosen.iter().map(|&e| scores[e]).collect();
        if c.norm_topk_prob {
            let sum = weights.iter().sum::<f32>() + 1e-20;
            weights.iter_mut().for_each(|w| *w /= sum);
        }
        chosen.into_iter().zip(weights.into_iter().map(|w| w * c.routed_scaling_factor)).collect()
    }
}

/// Indices of the `k` largest values (ties: the lower index first).
fn top_indices(values: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..values.len()).collect();
    idx.sort_by(|&a, &b| values[b].total_cmp(&values[a]).then(a.cmp(&b)));
    idx.truncate(k);
    idx
}
