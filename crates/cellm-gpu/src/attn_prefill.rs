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

/// `window_start` and `table_of`, for both kernels.
const SHARED: &str = include_str!("shaders/prefill_shared.wgsl");

/// The kernel's WGSL for heads of `head_dim` (after the step and KV accessors): the
/// decode kernel's `Params` (both launch with the same parameters), then the kernel.
pub fn source(head_dim: u32, attention: &str, kernel: &str) -> String {
    let tile = Tile::new(head_dim).expect("a supported head dim");
    let start = attention.find("struct Params").expect("attention.wgsl declares Params");
    let len = attention[start..].find("\n}\n").expect("Params ends") + 3;
    format!(
        "const HD: u32 = {head_dim}u;\nconst LPR: u32 = {}u;\nconst BQ: u32 = {BQ}u;\n\
         const BK: u32 = {}u;\n{}{SHARED}{kernel}",
        tile.lanes,
        tile.keys,
        &attention[start..start + len]
    )
}

/// The cooperative-matrix kernel (`shaders/attn_prefill_coop.wgsl`): subgroups of 32 (16
/// query rows each) per workgroup, 4 unless `CELLM_GPU_ATTN_COOP_SG` says 2 (for measuring).
pub fn coop_subgroups() -> u32 {
    match std::env::var("CELLM_GPU_ATTN_COOP_SG").ok().as_deref() {
        Some("2") => 2,
        _ => 4,
    }
}

/// Query tokens per workgroup of the cooperative-matrix kernel.
pub fn coop_block() -> u32 {
    16 * coop_subgroups()
}

/// Whether the cooperative-matrix kernel takes heads of `head_dim` (a multiple of 16, at
/// most 128: its query tile lives in registers, its key and value tiles in shared memory).
pub fn coop_head_dim_ok(head_dim: u32) -> bool {
    head_dim.is_multiple_of(16) && (16..=128).contains(&head_dim)
}

/// Bytes of shared memory the cooperative-matrix kernel takes for `head_dim`.
pub(crate) fn coop_shared_bytes(head_dim: u32) -> u32 {
    let nsg = coop_subgroups();
    let (bq, bk, ldk, ldp) = (16 * nsg, 32, head_dim / 4 + 2, 32 / 4 + 2);
    // (The two per-row arrays: each row's sum and max.)
    8 * bq * ldk + 8 * bk * ldk + 4 * nsg * 512 + 8 * nsg * 16 * ldp + 8 * bq + 16
}

/// The cooperative-matrix kernel's WGSL for heads of `head_dim` (after the step and KV
/// accessors): `Params`, then the kernel with each 16 x 16 tile's loads and multiply-adds
/// written out (one variable a tile: `q{d}` the query's, `o{d}` the output's, `c0` and `c1`
/// a key tile's scores).
pub fn coop_source(head_dim: u32, attention: &str, kernel: &str) -> String {
    assert!(coop_head_dim_ok(head_dim), "a supported head dim");
    let start = attention.find("struct Params").expect("attention.wgsl declares Params");
    let len = attention[start..].find("\n}\n").expect("Params ends") + 3;
    let nd = head_dim / 16;
    let block = |indent: usize, lines: Vec<String>| -> String {
        lines.iter().map(|l| format!("{:indent$}{l}\n", "")).collect()
    };
    let q = (0..nd)
        .map(|d| {
            let at = 4 * d;
            format!(
                "let q{d} = coopLoadT<coop_mat16x16<f16, A>>(&kt[sg * 16u * LDK + {at}u], LDK);"
            )
        })
        .collect();
    let zero = (0..nd).map(|d| format!("var o{d} = zero;")).collect();
    let mut scores = vec!["var c0 = zero;".to_string(), "var c1 = zero;".to_string()];
    for d in 0..nd {
        let at = 4 * d;
        for (j, row) in [(0, "0u"), (1, "16u")] {
            scores.push(format!(
                "c{j} = coopMultiplyAdd(q{d}, coopLoad<coop_mat16x16<f16, B>>(&kt[{row} * LDK + \
                 {at}u], LDK), c{j});"
            ));
        }
    }
    scores.push("coopStore(c0, &ss[sg * 512u], 16u);".into());
    scores.push("coopStore(c1, &ss[sg * 512u + 256u], 16u);".into());
    let mut pv = vec![
        "let pa0 = coopLoadT<coop_mat16x16<f16, A>>(&pt[sg * 16u * LDP], LDP);".to_string(),
        "let pa1 = coopLoadT<coop_mat16x16<f16, A>>(&pt[sg * 16u * LDP + 4u], LDP);".to_string(),
    ];
    for d in 0..nd {
        let at = 4 * d;
        for (j, row) in [(0, "0u"), (1, "16u")] {
            pv.push(format!(
                "o{d} = coopMultiplyAdd(pa{j}, coopLoadT<coop_mat16x16<f16, B>>(&vt[{row} * LDK \
                 + {at}u], LDK), o{d});"
            ));
        }
    }
    let mut store = Vec::new();
    for d in 0..nd {
        store.push(format!("coopStore(o{d}, &ss[sg * 512u], 16u);"));
        store.push("workgroupBarrier();".into());
        store.push(format!("emit(sg * 512u, lane, sg, t0, rows, h, {}u, wg.z);", 16 * d));
        store.push("workgroupBarrier();".into());
    }
    let body = kernel
        .replace("//@QLOAD\n", &block(4, q))
        .replace("//@OZERO\n", &block(4, zero))
        .replace("//@SCORES\n", &block(12, scores))
        .replace("//@PV\n", &block(12, pv))
        .replace("//@STORE\n", &block(4, store));
    format!(
        "const HD: u32 = {head_dim}u;\nconst NSG: u32 = {}u;\n{}{SHARED}{body}",
        coop_subgroups(),
        &attention[start..start + len]
    )
}
