//! The engine: a loaded model, a KV page pool, sessions, and the one batched forward step
//! that serves both prefill (one session, many tokens) and decode (many sessions, one each).

mod encoder;
pub mod synthetic;

pub use encoder::EncoderEngine;

use std::collections::HashMap;
use std::path::Path;

use cellm_format::{CellmFile, Error, Result, TensorFormat};
use cellm_kernels::{with_float_order, FloatOrder};
use cellm_kv::{KvConfig, PagePool, SeqKv, SeqSpan, SeqState};
use cellm_models::{CausalLm, ForwardError, GivenEmbeds, Step, MAX_CONTEXT};

pub use cellm_format;
pub use cellm_gpu::GpuKind;
pub use cellm_kernels::peak::fma_chains;
pub use cellm_kernels::pool::{stream_read, ThreadPool};
pub use cellm_kernels::{decode_row_raw, dot, isa, matmul_raw, WeightRows};
pub use cellm_kv::KvEncoding;

/// Tokens per KV page.
const PAGE_SIZE: usize = 16;
/// The most threads an engine starts (each is an OS thread, started at load).
const MAX_THREADS: usize = 1024;
/// Default KV capacity, in full-context sessions (pages are allocated only when used).
const DEFAULT_KV_SESSIONS: usize = 8;

#[derive(Debug, Clone)]
pub struct EngineOptions {
    /// Worker threads (the caller included); default: physical cores.
    pub threads: Option<usize>,
    pub kv_encoding: KvEncoding,
    /// Longest sequence a session may hold; default: the model's trained context.
    pub context_length: Option<usize>,
    /// KV capacity in tokens over all sessions; default: 8 full contexts.
    pub kv_capacity_tokens: Option<usize>,
    /// Run only the model's first this many layers (a debugging aid); default: all.
    pub max_layers: Option<usize>,
    /// Where the model runs: None on the CPU, else on a GPU of that kind.
    pub gpu: Option<GpuKind>,
    /// A cap on one GPU binding below the device's (tests split matrices with it).
    pub gpu_max_binding: Option<u64>,
    /// Share full KV pages between sessions by their token ids ([`Engine::reuse_prefix`]);
    /// models with recurrent state and the GPU backend keep it off whatever this says.
    pub prefix_cache: bool,
}

impl Default for EngineOptions {
    fn default() -> Self {
        Self {
            threads: None,
            kv_encoding: KvEncoding::F16,
            context_length: None,
            kv_capacity_tokens: None,
            max_layers: None,
            gpu: None,
            gpu_max_binding: None,
            prefix_cache: true,
        }
    }
}

/// Which positions' logits a step returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogitsMode {
    /// The last new token of each sequence.
    Last,
    /// Every new token of every sequence, in batch order.
    All,
}

pub type SessionId = u64;

/// Input embeddings for some new tokens of one batch entry of a step.
#[derive(Debug, Clone, Copy)]
pub struct Given<'a> {
    /// Index into the step's batch.
    pub entry: usize,
    /// Positions among that entry's new tokens.
    pub rows: &'a [usize],
    /// `rows.len() x hidden_size`.
    pub values: &'a [f32],
}

/// What one session owns: its KV pages and its recurrent state.
struct Session {
    kv: SeqKv,
    state: SeqState,
}

pub struct Engine {
    file: CellmFile,
    model: Box<dyn CausalLm>,
    pool: PagePool,
    state_layout: Vec<usize>,
    /// Steps only read the sessions' state ([`cellm_models::CacheLayout::state_fixed`]).
    state_fixed: bool,
    sessions: HashMap<SessionId, Session>,
    next_session: SessionId,
    workers: ThreadPool,
    context_length: usize,
    /// Some matrix is stored as floats (f32, f16, bf16) and multiplied on the CPU: a step
    /// that mixes decoding sessions with prompts runs as two forwards (`step_given`).
    float_weights: bool,
}

impl Engine {
    pub fn open(path: impl AsRef<Path>, opts: &EngineOptions) -> Result<Self> {
        let path = path.as_ref();
        let file = CellmFile::open(path)?;
        Self::from_file(file, opts).map_err(|e| match e {
            Error::Format(m) => Error::Format(format!("{}: {m}", path.display())),
            other => other,
        })
    }

    /// The engine of a file already opened (from a path or from bytes).
    pub fn from_file(file: CellmFile, opts: &EngineOptions) -> Result<Self> {
        let model = match opts.gpu {
            None => cellm_models::load_limited(&file, opts.max_layers)?,
            Some(_) if opts.max_layers.is_some() => {
                return Err(Error::InvalidArgument(
                    "max_layers is a CPU debugging aid; the GPU backend runs every layer".into(),
                ))
            }
            Some(kind) => cellm_gpu::load(
                &file,
                &cellm_gpu::GpuOptions {
                    kind,
                    kv_encoding: opts.kv_encoding,
                    page_size: PAGE_SIZE,
                    max_binding: opts.gpu_max_binding,
                },
            )?,
        };
        let cfg = model.config();
        let context_length = opts.context_length.unwrap_or(cfg.max_position_embeddings);
        let limit = model.position_limit().unwrap_or(MAX_CONTEXT).min(MAX_CONTEXT);
        if context_length == 0 || context_length > limit {
            return Err(Error::InvalidArgument(format!(
                "context_length must be 1 to {limit}, not {context_length}"
            )));
        }
        let workers = start_workers(opts.threads)?;
        let layout = model.cache_layout();
        // A cap on pages allocated on demand: saturating, the pool cannot address more
        // than MAX_PAGES anyway.
        let capacity =
            opts.kv_capacity_tokens.unwrap_or(context_length.saturating_mul(DEFAULT_KV_SESSIONS));
        let kv_config = KvConfig {
            num_layers: layout.kv_layers,
            kv_heads: layout.kv_heads,
            head_dim: layout.head_dim,
            page_size: PAGE_SIZE,
            max_pages: capacity.div_ceil(PAGE_SIZE).max(1).saturating_mul(layout.kv_layers),
            encoding: opts.kv_encoding,
            windows: layout.windows,
            values_in_keys: layout.values_in_keys,
        };
        // On a GPU the pool only hands out page ids; the model keeps the rows on the device.
        let mut pool = match opts.gpu {
            None => PagePool::new(kv_config),
            Some(_) => PagePool::without_storage(kv_config),
        };
        // A recurrent state (a short convolution's inputs, a linear-attention matrix, a
        // speech model's encoded audio) is not in the pages: a cached page alone cannot
        // restore the session that made it. Such models opt out. Idle cached pages are kept
        // up to one full context's worth, so an idle engine holds no more than that.
        if opts.prefix_cache && layout.state.is_empty() {
            let context_pages = context_length.div_ceil(PAGE_SIZE);
            pool.enable_prefix_cache(context_pages.saturating_mul(layout.kv_layers));
        }
        let float_weights = opts.gpu.is_none()
            && file.header().tensors.iter().any(|e| {
                e.shape.len() >= 2
                    && matches!(
                        TensorFormat::parse(&e.format),
                        Ok(TensorFormat::F32 | TensorFormat::F16 | TensorFormat::BF16)
                    )
            });
        Ok(Self {
            float_weights,
            file,
            model,
            pool,
            state_layout: layout.state,
            state_fixed: layout.state_fixed,
            sessions: HashMap::new(),
            next_session: 1,
            workers,
            context_length,
        })
    }

    pub fn file(&self) -> &CellmFile {
        &self.file
    }

    pub fn model(&self) -> &dyn CausalLm {
        self.model.as_ref()
    }

    pub fn pool(&self) -> &PagePool {
        &self.pool
    }

    pub fn context_length(&self) -> usize {
        self.context_length
    }

    pub fn threads(&self) -> usize {
        self.workers.threads()
    }

    /// Embedding rows (`tokens x hidden`) of preprocessed image tiles, on the engine's
    /// threads (`cellm_models::VisionEncoder::encode`); a text-only model refuses.
    pub fn encode_images(&self, patches: &[f32], grids: &[(usize, usize)]) -> Result<Vec<f32>> {
        let vision = self.model.vision().ok_or_else(|| {
            Error::InvalidArgument("this model takes no images (it has no vision encoder)".into())
        })?;
        self.workers.install(|| vision.encode(patches, grids))
    }

    /// Encodes one window of a speech model's features (`bins x frames`, row-major) on the
    /// engine's threads, makes the states session `id`'s cross-attention memory (replacing
    /// any earlier window's) and returns them (`positions x hidden`). A model without an
    /// audio encoder refuses.
    pub fn encode_speech(&mut self, id: SessionId, mel: &[f32]) -> Result<Vec<f32>> {
        let speech = self.model.speech().ok_or_else(|| {
            Error::InvalidArgument("this model takes no audio (it has no speech encoder)".into())
        })?;
        let session = self.sessions.get_mut(&id).ok_or_else(|| unknown(id))?;
        let encoded = self.workers.install(|| speech.encode(mel))?;
        self.workers.install(|| speech.attend_to(&encoded, &mut session.state))?;
        Ok(encoded)
    }

    pub fn create_session(&mut self) -> SessionId {
        let id = self.next_session;
        self.next_session += 1;
        let session = Session { kv: self.pool.new_seq(), state: SeqState::new(&self.state_layout) };
        self.sessions.insert(id, session);
        id
    }

    pub fn free_session(&mut self, id: SessionId) -> Result<()> {
        let mut session = self.sessions.remove(&id).ok_or_else(|| unknown(id))?;
        self.pool.release(&mut session.kv);
        Ok(())
    }

    /// Drops cached positions from `len` on (rewinding for regeneration or a shared prefix).
    /// Recurrent state cannot be rewound, so such models only reset (`len` 0); nor can a
    /// sliding layer get back positions that left its window. A state that steps only read
    /// (a speech model's window) is kept, whatever `len`.
    pub fn truncate_session(&mut self, id: SessionId, len: usize) -> Result<()> {
        let session = self.sessions.get_mut(&id).ok_or_else(|| unknown(id))?;
        let cached = session.kv.len();
        if len >= cached {
            return Ok(());
        }
        if len > 0 && !session.state.is_empty() && !self.state_fixed {
            return Err(Error::InvalidArgument(format!(
                "session {id}: this model keeps recurrent state, which cannot be rewound to \
                 position {len}; truncate to 0 to reset it"
            )));
        }
        if !self.pool.can_truncate(&session.kv, len) {
            return Err(Error::InvalidArgument(format!(
                "session {id}: position {len} is no longer in the sliding window of every \
                 layer (its pages were released); truncate to 0 to reset"
            )));
        }
        self.pool.truncate(&mut session.kv, len);
        if len == 0 && !self.state_fixed {
            session.state.reset();
        }
        Ok(())
    }

    /// Starts the empty session `id` with the longest cached prefix of `tokens` (whole
    /// pages, leaving at least the last token to step) and returns how many positions it
    /// holds now; the caller steps the rest. 0 with the prefix cache off.
    pub fn reuse_prefix(&mut self, id: SessionId, tokens: &[u32]) -> Result<usize> {
        let session = self.sessions.get_mut(&id).ok_or_else(|| unknown(id))?;
        if !session.kv.is_empty() {
            return Err(Error::InvalidArgument(format!(
                "session {id} already holds {} positions; reuse_prefix starts an empty one",
                session.kv.len()
            )));
        }
        Ok(self.pool.reuse_prefix(&mut session.kv, tokens))
    }

    pub fn session_len(&self, id: SessionId) -> Result<usize> {
        Ok(self.sessions.get(&id).ok_or_else(|| unknown(id))?.kv.len())
    }

    /// Runs one forward over the new tokens of each `(session, tokens)` pair and returns the
    /// requested logits (`rows x vocab`, row-major) with the row count. All-or-nothing: on an
    /// error no session changes.
    pub fn step(
        &mut self,
        batch: &[(SessionId, &[u32])],
        mode: LogitsMode,
    ) -> Result<(Vec<f32>, usize)> {
        self.step_cancellable(batch, mode, &|| false)
    }

    /// [`Engine::step`], asking `cancel` (on this thread) before it starts and between the
    /// forward's layers; once it says true the step stops with [`Error::Interrupted`] and
    /// every session is as before it: its length, its KV pages, its recurrent state. A model
    /// with recurrent state is stopped mid-forward only in steps that prefill (more than one
    /// token for some session), whose states are copied first to be put back; a decode step
    /// is short, and copying states every token would cost more than it saves.
    pub fn step_cancellable(
        &mut self,
        batch: &[(SessionId, &[u32])],
        mode: LogitsMode,
        cancel: &(dyn Fn() -> bool + Sync),
    ) -> Result<(Vec<f32>, usize)> {
        self.step_given(batch, &[], mode, cancel)
    }

    /// [`Engine::step_cancellable`] with some tokens' input embeddings given (a vision-
    /// language model's image features at its image tokens) instead of looked up.
    pub fn step_given(
        &mut self,
        batch: &[(SessionId, &[u32])],
        given: &[Given],
        mode: LogitsMode,
        cancel: &(dyn Fn() -> bool + Sync),
    ) -> Result<(Vec<f32>, usize)> {
        self.validate(batch)?;
        // Float products sum a token's terms in an order set per step (`FloatOrder`): one
        // for steps of one token per session, another for steps that prefill. A step that
        // mixes the two runs its prompts first, then its decoding sessions, so a decode
        // token's logits are the same bits alone or beside any prompt chunk.
        let decoding = |i: &usize| batch[*i].1.len() == 1;
        if self.float_weights && given.is_empty() && (0..batch.len()).any(|i| decoding(&i)) {
            let (one, more): (Vec<usize>, Vec<usize>) = (0..batch.len()).partition(decoding);
            if !more.is_empty() {
                return self.step_split(batch, [&more, &one], mode, cancel);
            }
        }
        let (embed_rows, embed_values) = self.given_rows(batch, given)?;
        if cancel() {
            return Err(Error::Interrupted);
        }
        self.reserve(batch)?;
        let tokens: Vec<u32> = batch.iter().flat_map(|(_, t)| t.iter().copied()).collect();
        // Each session's pages (read) and state (written) in batch order.
        let mut members: Vec<(usize, &SeqKv, &mut SeqState)> = self
            .sessions
            .iter_mut()
            .filter_map(|(id, s)| {
                let at = batch.iter().position(|(b, _)| b == id)?;
                Some((at, &s.kv, &mut s.state))
            })
            .collect();
        members.sort_unstable_by_key(|m| m.0);
        let mut spans = Vec::with_capacity(batch.len());
        let mut states = Vec::with_capacity(batch.len());
        let mut logit_rows = Vec::new();
        let mut row0 = 0;
        for ((_, kv, state), &(_, t)) in members.into_iter().zip(batch) {
            spans.push(SeqSpan { kv, start: kv.len(), len: t.len(), row0 });
            states.push(state);
            match mode {
                LogitsMode::Last => logit_rows.push(row0 + t.len() - 1),
                LogitsMode::All => logit_rows.extend(row0..row0 + t.len()),
            }
            row0 += t.len();
        }
        // A state that steps only read needs no copy and no care when cancelling.
        let stateful = !self.state_layout.is_empty() && !self.state_fixed;
        let prefill = batch.iter().any(|(_, t)| t.len() > 1);
        let saved: Vec<SeqState> = match stateful && prefill {
            true => states.iter().map(|s| SeqState::clone(s)).collect(),
            false => Vec::new(),
        };
        let never = || false;
        let cancel: &(dyn Fn() -> bool + Sync) = match stateful && !prefill {
            true => &never,
            false => cancel,
        };
        let embeds = GivenEmbeds { rows: &embed_rows, values: &embed_values };
        let step = Step { tokens: &tokens, spans: &spans, logit_rows: &logit_rows, embeds, cancel };
        let (model, pool) = (&self.model, &mut self.pool);
        let order = if prefill { FloatOrder::Batch } else { FloatOrder::Decode };
        let by_row = mode == LogitsMode::Last;
        let result = self.workers.install(|| {
            with_float_order(order, by_row, || model.forward(&step, pool, &mut states))
        });
        if result.is_err() {
            for (state, saved) in states.iter_mut().zip(saved) {
                **state = saved;
            }
        }
        drop((spans, states));
        let logits = match result {
            Ok(logits) => logits,
            Err(stopped) => {
                // Positions past each session's length hold the stopped step's rows; its
                // length never moved, so dropping the pages reserved for them restores it.
                self.unreserve(batch);
                return Err(match stopped {
                    ForwardError::Cancelled => Error::Interrupted,
                    ForwardError::Failed(e) => e,
                });
            }
        };
        for (i, &(id, t)) in batch.iter().enumerate() {
            let seq = &mut self.sessions.get_mut(&id).expect("validated").kv;
            let new_len = seq.len() + t.len();
            // Rows from given embeddings (and all after them) are not named by token ids.
            let rows = given.iter().filter(|g| g.entry == i).flat_map(|g| g.rows.iter());
            let known = rows.copied().min().unwrap_or(t.len());
            self.pool.commit_tokens(seq, new_len, &t[..known]);
        }
        Ok((logits, logit_rows.len()))
    }

    /// A step of prompts (`parts[0]`, entries of `batch`) and decoding sessions (`parts[1]`)
    /// as two steps, the prompts' first: pages for both are reserved before either runs, and
    /// only the first may be cancelled, so the step still succeeds or fails as a whole
    /// (short of a failing forward). The logits come back in batch order.
    fn step_split(
        &mut self,
        batch: &[(SessionId, &[u32])],
        parts: [&[usize]; 2],
        mode: LogitsMode,
        cancel: &(dyn Fn() -> bool + Sync),
    ) -> Result<(Vec<f32>, usize)> {
        self.reserve(batch)?;
        let pick = |ix: &[usize]| ix.iter().map(|&i| batch[i]).collect::<Vec<_>>();
        let (first, second) = (pick(parts[0]), pick(parts[1]));
        let a = match self.step_given(&first, &[], mode, cancel) {
            Ok(a) => a,
            Err(e) => {
                self.unreserve(&second);
                return Err(e);
            }
        };
        let b = self.step_given(&second, &[], mode, &|| false)?;
        let rows = |t: &[u32]| if mode == LogitsMode::Last { 1 } else { t.len() };
        let vocab = a.0.len() / a.1.max(1);
        let mut chunks: Vec<&[f32]> = vec![&[]; batch.len()];
        for (part, (logits, _)) in parts.iter().zip([&a, &b]) {
            let mut at = 0;
            for &i in part.iter() {
                let n = rows(batch[i].1) * vocab;
                chunks[i] = &logits[at..at + n];
                at += n;
            }
        }
        Ok((chunks.concat(), a.1 + b.1))
    }

    /// Reserves the pages each batch session's new tokens need: all of them, or none (an
    /// error gives back what the sessions before it got).
    fn reserve(&mut self, batch: &[(SessionId, &[u32])]) -> Result<()> {
        for (i, &(id, tokens)) in batch.iter().enumerate() {
            let seq = &mut self.sessions.get_mut(&id).expect("validated").kv;
            let new_len = seq.len() + tokens.len();
            if let Err(e) = self.pool.reserve(seq, new_len) {
                self.unreserve(&batch[..i]);
                return Err(e);
            }
        }
        Ok(())
    }

    /// Gives back the pages reserved past each batch session's length.
    fn unreserve(&mut self, batch: &[(SessionId, &[u32])]) {
        for &(id, _) in batch {
            let s = &mut self.sessions.get_mut(&id).expect("validated").kv;
            let len = s.len();
            self.pool.truncate(s, len);
        }
    }

    /// `given` as rows of the step's concatenated tokens, checked against the batch.
    fn given_rows(
        &self,
        batch: &[(SessionId, &[u32])],
        given: &[Given],
    ) -> Result<(Vec<usize>, Vec<f32>)> {
        let hidden = self.model.config().hidden_size;
        let starts: Vec<usize> = batch
            .iter()
            .scan(0, |row0, (_, t)| {
                let start = *row0;
                *row0 += t.len();
                Some(start)
            })
            .collect();
        let (mut rows, mut values) = (Vec::new(), Vec::new());
        for g in given {
            let Some(&(id, tokens)) = batch.get(g.entry) else {
                return Err(Error::InvalidArgument(format!(
                    "embeddings given for batch entry {}, of {}",
                    g.entry,
                    batch.len()
                )));
            };
            if Some(g.values.len()) != g.rows.len().checked_mul(hidden) {
                return Err(Error::InvalidArgument(format!(
                    "session {id}: {} embedding values for {} rows of {hidden}",
                    g.values.len(),
                    g.rows.len()
                )));
            }
            if let Some(bad) = g.rows.iter().find(|&&r| r >= tokens.len()) {
                return Err(Error::InvalidArgument(format!(
                    "session {id}: an embedding for token {bad} of {} new tokens",
                    tokens.len()
                )));
            }
            rows.extend(g.rows.iter().map(|r| starts[g.entry] + r));
            values.extend_from_slice(g.values);
        }
        Ok((rows, values))
    }

    fn validate(&self, batch: &[(SessionId, &[u32])]) -> Result<()> {
        if batch.is_empty() {
            return Err(Error::InvalidArgument("a step needs at least one session".into()));
        }
        let vocab = self.model.config().vocab_size;
        for (i, &(id, tokens)) in batch.iter().enumerate() {
            let seq = &self.sessions.get(&id).ok_or_else(|| unknown(id))?.kv;
            if batch[..i].iter().any(|(other, _)| *other == id) {
                return Err(Error::InvalidArgument(format!(
                    "session {id} appears twice in one step"
                )));
            }
            if tokens.is_empty() {
                return Err(Error::InvalidArgument(format!("session {id}: no tokens to process")));
            }
            if let Some(bad) = tokens.iter().find(|&&t| t as usize >= vocab) {
                return Err(Error::InvalidArgument(format!(
                    "token id {bad} is outside the vocabulary ({vocab})"
                )));
            }
            if seq.len() + tokens.len() > self.context_length {
                return Err(Error::ContextOverflow(format!(
                    "{} tokens ({} cached + {} new) exceed the context length of {}",
                    seq.len() + tokens.len(),
                    seq.len(),
                    tokens.len(),
                    self.context_length
                )));
            }
        }
        Ok(())
    }
}

fn unknown(id: SessionId) -> Error {
    Error::InvalidArgument(format!("no session {id}"))
}

/// Physical cores: decode is bandwidth-bound and SMT siblings share the same load ports.
/// The worker pool of `threads` threads (default: the physical cores).
fn start_workers(threads: Option<usize>) -> Result<ThreadPool> {
    let threads = match threads {
        Some(n) if n == 0 || n > MAX_THREADS => {
            return Err(Error::InvalidArgument(format!(
                "threads must be 1 to {MAX_THREADS}, not {n}"
            )))
        }
        Some(n) => n,
        None => default_threads(),
    };
    ThreadPool::new(threads)
        .map_err(|e| Error::InvalidArgument(format!("cannot start {threads} threads: {e}")))
}

fn default_threads() -> usize {
    let logical = std::thread::available_parallelism().map_or(1, |n| n.get());
    physical_cores().unwrap_or(logical).clamp(1, logical)
}

fn physical_cores() -> Option<usize> {
    let info = std::fs::read_to_string("/proc/cpuinfo").ok()?;
    let mut cores = std::collections::HashSet::new();
    let mut physical = None;
    for line in info.lines() {
        if let Some(v) = line.strip_prefix("physical id") {
            physical = v.trim_start_matches([' ', '\t', ':']).parse::<u32>().ok();
        } else if let Some(v) = line.strip_prefix("core id") {
            let core = v.trim_start_matches([' ', '\t', ':']).parse::<u32>().ok()?;
            cores.insert((physical, core));
        }
    }
    (!cores.is_empty()).then_some(cores.len())
}
