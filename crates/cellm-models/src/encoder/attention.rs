//! Bidirectional attention of each sequence to itself, optionally within a band of
//! positions (`|i - j| <= band`) and with a learned per-head sink logit that joins each
//! softmax's denominator without a value (gpt-oss style). Grouped-query heads share keys.

use cellm_format::TensorFormat;
use cellm_kernels::gating::exp_in_place;
use cellm_kernels::gemm::{pack_tokens, FloatGemm};
use cellm_kernels::pool::{parallel_for, SharedOut};
use cellm_kernels::{isa, WeightRows};

/// Queries per tile: their scores against the tile's keys stay in L2.
const QUERY_TILE: usize = 128;

/// The shape of one attention call.
#[derive(Debug, Clone, Copy)]
pub struct Band<'a> {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Multiplies `q . k`.
    pub scale: f32,
    /// The farthest key a query sees on either side (None: the whole sequence).
    pub band: Option<usize>,
    /// One logit per head (None: no sinks).
    pub sinks: Option<&'a [f32]>,
}

/// Rows of a matrix that sit in a wider buffer: row `t` is `data[t * stride + offset..]`.
#[derive(Debug, Clone, Copy)]
pub struct Rows<'a> {
    pub data: &'a [f32],
    pub stride: usize,
    pub offset: usize,
}

impl<'a> Rows<'a> {
    /// A plain `rows x width` matrix.
    pub fn dense(data: &'a [f32], width: usize) -> Self {
        Self { data, stride: width, offset: 0 }
    }

    /// Columns `c0..c0 + n` of row `t`.
    fn at(&self, t: usize, c0: usize, n: usize) -> &'a [f32] {
        &self.data[t * self.stride + self.offset + c0..][..n]
    }
}

/// Context rows (`tokens x heads * head_dim`) of `q` (`tokens x heads * head_dim`) over `k`,
/// `v` (`tokens x kv_heads * head_dim`), each sequence (`lens`, consecutive rows) on its own.
pub fn banded_attention(q: &[f32], k: &[f32], v: &[f32], lens: &[usize], a: &Band) -> Vec<f32> {
    let (qw, kw) = (a.heads * a.head_dim, a.kv_heads * a.head_dim);
    let tokens: usize = lens.iter().sum();
    let mut ctx = vec![0.0; tokens * qw];
    banded_attention_into(
        Rows::dense(q, qw),
        Rows::dense(k, kw),
        Rows::dense(v, kw),
        lens,
        a,
        &mut ctx,
    );
    ctx
}

/// [`banded_attention`] reading q, k and v where they lie (each head's columns in place) and
/// writing the context into `ctx` (`tokens x heads * head_dim`). (sequence, head) pairs run
/// in parallel on the installed pool, each on the f32 GEMM serially.
pub fn banded_attention_into(q: Rows, k: Rows, v: Rows, lens: &[usize], a: &Band, ctx: &mut [f32]) {
    let (hd, group) = (a.head_dim, a.heads / a.kv_heads);
    let qw = a.heads * hd;
    let tokens: usize = lens.iter().sum();
    assert_eq!(ctx.len(), tokens * qw, "attention: context is not tokens x heads * head_dim");
    let starts: Vec<usize> =
        lens.iter().scan(0, |at, &n| Some(std::mem::replace(at, *at + n))).collect();
    let out = SharedOut(ctx.as_mut_ptr());
    parallel_for(lens.len() * a.heads, |task| {
        let (s, h) = (task / a.heads, task % a.heads);
        let (r0, n) = (starts[s], lens[s]);
        if n == 0 {
            return;
        }
        let kv = h / group;
        let head = Head {
            q: Rows { data: q.data, stride: q.stride, offset: q.offset + h * hd },
            k: Rows { data: k.data, stride: k.stride, offset: k.offset + kv * hd },
            v: Rows { data: v.data, stride: v.stride, offset: v.offset + kv * hd },
            first: r0,
            n,
            hd,
        };
        let sink = a.sinks.map(|s| s[h]);
        // SAFETY: task (s, h) writes only head h's columns of sequence s's rows.
        one_head(&head, a.scale, a.band, sink, |i, d0, vals| unsafe {
            let at = out.at((r0 + i) * qw + h * hd + d0);
            // An element loop, not a memcpy call per 16 values.
            let dst = std::slice::from_raw_parts_mut(at, vals.len());
            dst.iter_mut().zip(vals).for_each(|(d, v)| *d = *v);
        });
    });
}

/// One head of one sequence: rows `first..first + n` of q, k and v, each `hd` wide.
struct Head<'a> {
    q: Rows<'a>,
    k: Rows<'a>,
    v: Rows<'a>,
    first: usize,
    n: usize,
    hd: usize,
}

/// One head of one sequence; `store(i, d0, vals)`: the context of query `i < n` at dims
/// `d0..d0 + vals.len()`.
fn one_head(
    x: &Head,
    scale: f32,
    band: Option<usize>,
    sink: Option<f32>,
    mut store: impl FnMut(usize, usize, &[f32]),
) {
    let (n, hd) = (x.n, x.hd);
    let reach = band.unwrap_or(n);
    SCRATCH.with_borrow_mut(|sc| {
        let Scratch { kh, vt, vt_tile, qt, scores } = sc;
        // The head's keys as weight rows, its values transposed (one weight row per dim).
        kh.clear();
        vt.resize(hd * n, 0.0);
        for j in 0..n {
            kh.extend_from_slice(x.k.at(x.first + j, 0, hd));
            for (d, &val) in x.v.at(x.first + j, 0, hd).iter().enumerate() {
                vt[d * n + j] = val;
            }
        }
        for i0 in (0..n).step_by(QUERY_TILE) {
            let i1 = (i0 + QUERY_TILE).min(n);
            let rows = i1 - i0;
            let (lo, hi) = (i0.saturating_sub(reach), (i1 - 1).saturating_add(reach + 1).min(n));
            let m = hi - lo;
            qt.clear();
            (i0..i1).for_each(|i| qt.extend_from_slice(x.q.at(x.first + i, 0, hd)));
            // Every score is stored (and scaled) by the product: no clearing.
            scores.resize(rows * m, 0.0);
            let scores = &mut scores[..rows * m];
            gemm_of(f32_rows(&kh[lo * hd..hi * hd], m, hd)).run(
                &pack_tokens(qt, rows, hd),
                rows,
                0..m,
                |t, r0, vals| {
                    let dst = &mut scores[t * m + r0..][..vals.len()];
                    dst.iter_mut().zip(vals).for_each(|(d, v)| *d = v * scale);
                },
            );
            for (r, row) in scores.chunks_exact_mut(m).enumerate() {
                let i = i0 + r;
                // The keys this query sees: a contiguous run of the tile's keys.
                let (a, b) = (i.saturating_sub(reach) - lo, (i + reach + 1).min(hi) - lo);
                row[..a].fill(0.0);
                row[b..].fill(0.0);
                let seen = &mut row[a..b];
                let mut max = lane_max(seen);
                if let Some(s) = sink {
                    max = max.max(s);
                }
                seen.iter_mut().for_each(|s| *s -= max);
                exp_in_place(seen);
                let total = lane_sum(seen, |v| v) + sink.map_or(0.0, |s| (s - max).exp());
                let inv = 1.0 / total;
                seen.iter_mut().for_each(|s| *s *= inv);
            }
            // Context = P V over the tile's keys.
            let vt_rows: &[f32] = if m == n {
                vt
            } else {
                vt_tile.clear();
                (0..hd).for_each(|d| vt_tile.extend_from_slice(&vt[d * n + lo..d * n + hi]));
                vt_tile
            };
            let (pv, packed) = (gemm_of(f32_rows(vt_rows, hd, m)), pack_tokens(scores, rows, m));
            pv.run(&packed, rows, 0..hd, |t, d0, vals| store(i0 + t, d0, vals));
        }
    });
}

/// One thread's buffers for [`one_head`], kept from head to head.
#[derive(Default)]
struct Scratch {
    kh: Vec<f32>,
    vt: Vec<f32>,
    vt_tile: Vec<f32>,
    qt: Vec<f32>,
    scores: Vec<f32>,
}

thread_local! {
    static SCRATCH: std::cell::RefCell<Scratch> = std::cell::RefCell::new(Scratch::default());
}

/// `sum f(v)` over `row` in eight lanes, which the compiler vectorizes (a plain `sum` must
/// add in order, one at a time).
#[inline(always)]
pub(crate) fn lane_sum(row: &[f32], f: impl Fn(f32) -> f32) -> f32 {
    let mut acc = [0.0f32; 8];
    let chunks = row.chunks_exact(8);
    let tail: f32 = chunks.remainder().iter().map(|&v| f(v)).sum();
    for c in chunks {
        acc.iter_mut().zip(c).for_each(|(a, &v)| *a += f(v));
    }
    acc.iter().sum::<f32>() + tail
}

/// The largest of `row` (NEG_INFINITY when empty), in eight lanes.
#[inline(always)]
fn lane_max(row: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; 8];
    let chunks = row.chunks_exact(8);
    let tail = chunks.remainder().iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    for c in chunks {
        acc.iter_mut().zip(c).for_each(|(a, &v)| *a = if v > *a { v } else { *a });
    }
    acc.iter().fold(tail, |m, &v| m.max(v))
}

fn gemm_of(w: WeightRows) -> FloatGemm {
    FloatGemm::new(w, isa::selected())
}

/// An f32 matrix as weight rows for the kernels' products.
pub(crate) fn f32_rows(x: &[f32], rows: usize, cols: usize) -> WeightRows<'_> {
    debug_assert_eq!(x.len(), rows * cols);
    // SAFETY: any f32 slice is a valid byte slice of 4 times its length.
    let bytes = unsafe { std::slice::from_raw_parts(x.as_ptr().cast::<u8>(), x.len() * 4) };
    WeightRows { format: TensorFormat::F32, bytes, rows, cols }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A float64 transcription of the definition, one query at a time.
    fn reference(q: &[f32], k: &[f32], v: &[f32], n: usize, a: &Band) -> Vec<f32> {
        let hd = a.head_dim;
        let mut out = vec![0.0; n * a.heads * hd];
        for h in 0..a.heads {
            let kv = h / (a.heads / a.kv_heads);
            for i in 0..n {
                let qi = &q[i * a.heads * hd + h * hd..][..hd];
                let seen: Vec<usize> =
                    (0..n).filter(|&j| a.band.is_none_or(|b| i.abs_diff(j) <= b)).collect();
                let logits: Vec<f64> = seen
                    .iter()
                    .map(|&j| {
                        let kj = &k[j * a.kv_heads * hd + kv * hd..][..hd];
                        qi.iter().zip(kj).map(|(x, y)| f64::from(*x) * f64::from(*y)).sum::<f64>()
                            * f64::from(a.scale)
                    })
                    .collect();
                let sink = a.sinks.map(|s| f64::from(s[h]));
                let max = logits.iter().copied().chain(sink).fold(f64::NEG_INFINITY, f64::max);
                let total: f64 = logits.iter().map(|l| (l - max).exp()).sum::<f64>()
                    + sink.map_or(0.0, |s| (s - max).exp());
                for (&j, l) in seen.iter().zip(&logits) {
                    let p = (l - max).exp() / total;
                    for d in 0..hd {
                        out[i * a.heads * hd + h * hd + d] +=
                            (p * f64::from(v[j * a.kv_heads * hd + kv * hd + d])) as f32;
                    }
                }
            }
        }
        out
    }

    fn pseudo(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| {
                ((i as u32 ^ seed).wrapping_mul(2_654_435_761) >> 8) as f32 / 16_777_216.0 - 0.5
            })
            .collect()
    }

    #[test]
    fn matches_the_definition_across_tiles_bands_and_sinks() {
        let sinks = [0.3, -1.0, 2.0, 0.0];
        for (n, band, with_sinks) in
            [(150, Some(16), true), (70, None, false), (5, Some(1), true), (130, Some(200), false)]
        {
            let a = Band {
                heads: 4,
                kv_heads: 2,
                head_dim: 8,
                scale: 0.7,
                band,
                sinks: with_sinks.then_some(&sinks[..]),
            };
            let (q, k, v) = (pseudo(n * 32, 1), pseudo(n * 16, 2), pseudo(n * 16, 3));
            let got = banded_attention(&q, &k, &v, &[n], &a);
            let want = reference(&q, &k, &v, n, &a);
            let err = got.iter().zip(&want).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max);
            assert!(err < 1e-5, "n {n} band {band:?}: max error {err}");
        }
    }

    #[test]
    fn sequences_of_a_batch_do_not_see_each_other() {
        let a = Band { heads: 2, kv_heads: 1, head_dim: 4, scale: 0.5, band: None, sinks: None };
        let (q, k, v) = (pseudo(9 * 8, 4), pseudo(9 * 4, 5), pseudo(9 * 4, 6));
        let both = banded_attention(&q, &k, &v, &[4, 0, 5], &a);
        let first = banded_attention(&q[..32], &k[..16], &v[..16], &[4], &a);
        let second = banded_attention(&q[32..], &k[16..], &v[16..], &[5], &a);
        assert_eq!(both, [first, second].concat());
    }
}
