//! What every family shares: the model itself (embedding, a stack of decoder layers, the
//! head), the residual loop over layers, token mixers that are either attention or a
//! recurrent block, and the cache layout they imply. A family only defines its layer.

use cellm_kernels::{for_logit_rows, ops};
use cellm_kv::{PagePool, SeqState};

use cellm_format::Result;

use crate::blocks::{gather_rows, Attention, Embedding, LmHead};
use crate::weights::Weights;
use crate::{CacheLayout, Cancelled, CausalLm, ForwardError, ModelConfig, Step};

/// A decoder-only language model: embed, run the layers, project to logits.
pub struct Decoder<L> {
    pub cfg: ModelConfig,
    pub embed: Embedding,
    pub layers: Vec<L>,
    pub head: LmHead,
    pub cache: CacheLayout,
}

impl<L: DecoderLayer + Send + Sync + 'static> Decoder<L> {
    /// The model around `layers`: the token embedding `embed`, and the head behind the final
    /// norm `final_norm` (tied to the embedding when the config says so).
    pub fn assemble(
        w: &Weights,
        cfg: ModelConfig,
        embed: Embedding,
        layers: Vec<L>,
        final_norm: &str,
        cache: CacheLayout,
    ) -> Result<Box<dyn CausalLm>> {
        let head = LmHead::load(w, final_norm, &cfg, &embed)?;
        Ok(Box::new(Self { cfg, embed, layers, head, cache }))
    }
}

impl<L: DecoderLayer + Send + Sync> CausalLm for Decoder<L> {
    fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    fn cache_layout(&self) -> CacheLayout {
        self.cache.clone()
    }

    fn forward(
        &self,
        step: &Step,
        kv: &mut PagePool,
        states: &mut [&mut SeqState],
    ) -> std::result::Result<Vec<f32>, ForwardError> {
        let c = &self.cfg;
        let positions = step.positions();
        let mut x = self
            .embed
            .lookup(step.tokens, c.embedding_multiplier)
            .expect("ids checked by the engine");
        let given = step.embeds;
        for (&row, values) in given.rows.iter().zip(given.values.chunks_exact(c.hidden_size)) {
            x[row * c.hidden_size..(row + 1) * c.hidden_size].copy_from_slice(values);
        }
        let mut ctx = StepCtx { step, positions: &positions, kv, states };
        let layers = &self.layers[..c.layers_run()];
        let (mut x, rows) = run_layers(layers, x, c.hidden_size, c.residual_multiplier, &mut ctx)?;
        Ok(for_logit_rows(|| self.head.forward(&mut x, rows)))
    }
}

/// What a layer may read and write during one step.
pub struct StepCtx<'a, 'b> {
    pub step: &'a Step<'a>,
    pub positions: &'a [usize],
    pub kv: &'a mut PagePool,
    /// Per span of `step`, its session's recurrent state.
    pub states: &'a mut [&'b mut SeqState],
}

/// One decoder layer as two residual branches.
pub trait DecoderLayer {
    /// The token-mixing branch (attention, convolution, recurrence), norms included.
    fn mix(&self, x: &[f32], ctx: &mut StepCtx) -> Vec<f32>;
    /// The feed-forward branch over `rows` rows, norms included.
    fn feed_forward(&self, x: &[f32], rows: usize) -> Vec<f32>;
}

/// Runs `x += scale * mix(x); x += scale * feed_forward(x)` through `layers`. Only the rows
/// whose logits the step wants go through the last feed-forward; those rows are returned.
/// The step's cancel hook is asked before each branch of each layer.
pub fn run_layers<L: DecoderLayer>(
    layers: &[L],
    mut x: Vec<f32>,
    hidden: usize,
    residual_scale: f32,
    ctx: &mut StepCtx,
) -> std::result::Result<(Vec<f32>, usize), Cancelled> {
    let mut rows = ctx.step.tokens.len();
    let cancel = ctx.step.cancel;
    for (i, layer) in layers.iter().enumerate() {
        if cancel() {
            return Err(Cancelled);
        }
        let mixed = layer.mix(&x, ctx);
        ops::add_scaled(&mut x, &mixed, residual_scale);
        if i + 1 == layers.len() {
            x = gather_rows(&x, hidden, ctx.step.logit_rows);
            rows = ctx.step.logit_rows.len();
        }
        if cancel() {
            return Err(Cancelled);
        }
        let ff = match i + 1 == layers.len() {
            true => for_logit_rows(|| layer.feed_forward(&x, rows)),
            false => layer.feed_forward(&x, rows),
        };
        ops::add_scaled(&mut x, &ff, residual_scale);
    }
    Ok((x, rows))
}

/// A token mixer that keeps per-session state instead of a KV cache.
pub trait RecurrentBlock {
    /// Floats of each state buffer it owns, in the order of its buffer indices.
    fn state_sizes(&self) -> Vec<usize>;
    fn forward(&self, x: &[f32], step: &Step, states: &mut [&mut SeqState]) -> Vec<f32>;
}

/// A hybrid model's mixer: a recurrent block, or attention with its index among KV layers.
pub enum Mixer<R> {
    Recurrent(Box<R>),
    Attention(Box<Attention>, usize),
}

impl<R: RecurrentBlock> Mixer<R> {
    pub fn forward(&self, x: &[f32], ctx: &mut StepCtx) -> Vec<f32> {
        match self {
            Mixer::Recurrent(block) => block.forward(x, ctx.step, ctx.states),
            Mixer::Attention(attn, kv_layer) => {
                attn.forward(*kv_layer, x, ctx.step, ctx.positions, ctx.kv)
            }
        }
    }
}

/// The cache a hybrid model needs: KV pages for its attention layers, state buffers for
/// its recurrent blocks.
pub fn hybrid_cache_layout<'m, R: RecurrentBlock + 'm>(
    cfg: &ModelConfig,
    mixers: impl Iterator<Item = &'m Mixer<R>>,
) -> CacheLayout {
    let mut layout = CacheLayout {
        kv_layers: 0,
        kv_heads: cfg.num_kv_heads,
        head_dim: cfg.head_dim,
        windows: Vec::new(),
        state: Vec::new(),
        values_in_keys: false,
        state_fixed: false,
    };
    for mixer in mixers {
        match mixer {
            Mixer::Recurrent(block) => layout.state.extend(block.state_sizes()),
            Mixer::Attention(..) => layout.kv_layers += 1,
        }
    }
    layout
}

/// The cache of a model whose every layer is (full or sliding) attention.
pub fn attention_cache_layout(cfg: &ModelConfig) -> CacheLayout {
    CacheLayout {
        kv_layers: cfg.num_layers,
        kv_heads: cfg.num_kv_heads,
        head_dim: cfg.head_dim,
        windows: (0..cfg.num_layers).map(|i| cfg.window(i)).collect(),
        state: Vec::new(),
        values_in_keys: false,
        state_fixed: false,
    }
}
