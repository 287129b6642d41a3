//! Prefill attention (`shaders/attn_prefill.wgsl`): a tile of query tokens per workgroup
//! sharing each key/value load, for steps whose sessions bring many tokens each. Decode-like
//! steps keep the split decode kernel and its combine (`shaders/attention.wgsl`), which
//! spreads one token's context over many workgroups instead.

/// Query tokens per workgroup (`BQ`).
pub const BQ: u32 = 16;
/// Shared memory the kernel may take: 32 KiB, what lavapipe, Metal and NVIDIA's Vulkan offer.
const SHARED_BYTES: u32 = 32 << 10;
/// Tokens per session (on average over a step's sessions) from which the prefill kernel
/// runs: one workgroup's full tile (not measured yet; below it the decode kernel's splits
/// keep a large GPU busy).
pub const MIN_TOKENS_PER_SESSION: usize = BQ as usize;

/// The kernel's shape for heads of `head_dim`, or None where it does not run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tile {
    /// Threads per query row (`LPR`), each summing `head_dim / lanes` value dims.
    pub lanes: u32,
    /// Positions per key/value tile (`BK`).
    pub keys: u32,
}

impl Tile {
    /// 8 lanes a row for head dims a multiple of 32, 4 for other multiples of 16 (each lane
    /// holds whole vec4s of the output); key tiles as long as 32 KiB of shared memory allow,
    /// at most 64.
    pub fn new(head_dim: u32) -> Option<Self> {
        let lanes = match head_dim {
            d if d > 256 => return None,
            d if d.is_multiple_of(32) => 8,
            d if d.is_multiple_of(16) => 4,
            _ => return None,
        };
        // Floats: the query tile and a key/value tile (rows padded by 4), the scores, and
        // the reduction slots.
        let row = head_dim + 4;
        let free = (SHARED_BYTES / 4).checked_sub(BQ * row + BQ * lanes)?;
        let keys = (free / (row + BQ)).min(64) / 8 * 8;
        (keys >= 8).then_some(Tile { lanes, keys })
    }

    /// Bytes of shared memory the kernel takes for `head_dim`.
    pub(crate) fn shared_bytes(self, head_dim: u32) -> u32 {
        4 * ((BQ + self.keys) * (head_dim + 4) + BQ * self.keys + BQ * self.lanes)
    }
}

/// The kernel's WGSL for heads of `head_dim` (after the step and KV accessors): the
/// decode kernel's `Params` (both launch with the same parameters), then the kernel.
pub fn source(head_dim: u32, attention: &str, kernel: &str) -> String {
    let tile = Tile::new(head_dim).expect("a supported head dim");
    let start = attention.find("struct Params").expect("attention.wgsl declares Params");
    let len = attention[start..].find("\n}\n").expect("Params ends") + 3;
    format!(
        "const HD: u32 = {head_dim}u;\nconst LPR: u32 = {}u;\nconst BQ: u32 = {BQ}u;\n\
         const BK: u32 = {}u;\n{}{kernel}",
        tile.lanes,
        tile.keys,
        &attention[start..start + len]
    )
}
