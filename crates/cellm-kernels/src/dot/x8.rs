//! Interleaved formats (`q8_0x8`, `q4_0x8`, `q4_1x8`, `q5_0x8`, `q4_kx8`): groups of 8 rows stored block column
//! by block column, so one 32-byte load holds 4 quants of each of the 8 rows and an integer
//! multiply-add leaves one row per lane (no horizontal sums, scales applied 8 rows at a time).
//!
//! Per group and block column: the blocks' f16 fields, field by field (`d` of rows 0..8, then
//! `m` of rows 0..8 for q4_1), then the rest of each block in 4-byte chunks, chunk by chunk
//! (chunk `c` of rows 0..8, then chunk `c + 1`; q5_0's first chunk is its `qh`, q4_k's
//! first three its packed scales). The bytes are exactly the source blocks, permuted.
//!
//! This file holds the layout and the scalar reference, which takes each row back out into
//! its source blocks and runs the row kernel on it.

use cellm_format::{Interleaved, TensorFormat, INTERLEAVE};

use super::int_scalar;
use crate::acts::Q8Row;

/// Most tokens one group-kernel call takes.
pub const MAX_TOKENS: usize = 8;

/// `out[t][r] = dot(row r of the group, x[t])` for `x.len() == out.len()` tokens (1..=8).
pub type QDotX8Fn = fn(&[u8], &[Q8Row], &mut [[f32; INTERLEAVE]]);

/// A group kernel for two neighbouring groups at once (the slice holds both, in order):
/// `out[t]` is the first group's 8 outputs, then the second's, bitwise what the group kernel
/// gives for each.
pub type QDotX16Fn = fn(&[u8], &[Q8Row], &mut [[f32; 2 * INTERLEAVE]]);

/// Panics unless a group kernel's arguments fit: whole block columns, one output per
/// activation row, and activation rows (with their sums of 16 where `sums16`) that cover the
/// group's columns.
pub(super) fn check_group_args(
    format: TensorFormat,
    group: &[u8],
    x: &[Q8Row],
    outs: usize,
    sums16: bool,
) {
    let base = format.interleaved().expect("interleaved").base;
    let elems = group.len() / INTERLEAVE / base.block_bytes() * base.block_len();
    assert!(
        group.len().is_multiple_of(INTERLEAVE * base.block_bytes()) && x.len() == outs,
        "{format:?} group kernel: bad arguments"
    );
    for r in x {
        assert!(r.qs.len() >= elems && r.ds.len() * 32 >= elems, "activations too short");
        assert!(!sums16 || r.sums16.len() * 16 >= elems, "the activations' sums of 16 are missing");
    }
}

/// Copies row `lane` of an interleaved `group` out as the source format's row.
pub fn row_of_group(format: TensorFormat, group: &[u8], lane: usize, out: &mut Vec<u8>) {
    let Interleaved { base, fields, fields_at } = format.interleaved().expect("interleaved");
    let rest = base.block_bytes() - fields;
    out.clear();
    let mut block = Vec::with_capacity(base.block_bytes());
    for column in group.chunks_exact(INTERLEAVE * base.block_bytes()) {
        block.clear();
        let chunks = &column[INTERLEAVE * fields..];
        for c in 0..rest / 4 {
            let at = 4 * (c * INTERLEAVE + lane);
            block.extend_from_slice(&chunks[at..at + 4]);
        }
        // The fields go back to their place in the source block.
        out.extend_from_slice(&block[..fields_at]);
        for field in 0..fields / 2 {
            let at = 2 * (field * INTERLEAVE + lane);
            out.extend_from_slice(&column[at..at + 2]);
        }
        out.extend_from_slice(&block[fields_at..]);
    }
}

/// The inverse of [`row_of_group`] for 8 source rows (tests and tools).
pub fn group_of_rows(format: TensorFormat, rows: &[&[u8]; INTERLEAVE]) -> Vec<u8> {
    let Interleaved { base, fields, fields_at } = format.interleaved().expect("interleaved");
    let bytes = base.block_bytes();
    let mut out = Vec::with_capacity(INTERLEAVE * rows[0].len());
    for b in 0..rows[0].len() / bytes {
        let blocks = rows.map(|r| &r[b * bytes..(b + 1) * bytes]);
        for field in 0..fields / 2 {
            let at = fields_at + 2 * field;
            blocks.iter().for_each(|blk| out.extend_from_slice(&blk[at..at + 2]));
        }
        let rest: [Vec<u8>; INTERLEAVE] =
            blocks.map(|blk| [&blk[..fields_at], &blk[fields_at + fields..]].concat());
        for c in 0..(bytes - fields) / 4 {
            rest.iter().for_each(|r| out.extend_from_slice(&r[4 * c..4 * c + 4]));
        }
    }
    out
}

/// The scalar reference: every row taken out of the group and run through the row kernel.
fn reference<const I: usize>(group: &[u8], x: &[Q8Row], out: &mut [[f32; INTERLEAVE]]) {
    let format = TensorFormat::INTERLEAVED[I];
    let base = format.interleaved().expect("interleaved").base;
    let (one, _) = int_scalar::qdot(base).expect("every interleaved base has an integer kernel");
    let mut row = Vec::new();
    for lane in 0..INTERLEAVE {
        row_of_group(format, group, lane, &mut row);
        for (o, xt) in out.iter_mut().zip(x) {
            o[lane] = one(&row, *xt);
        }
    }
}

/// The scalar group kernel of an interleaved format.
pub fn scalar(format: TensorFormat) -> Option<QDotX8Fn> {
    const REFS: [QDotX8Fn; 6] = [
        reference::<0>,
        reference::<1>,
        reference::<2>,
        reference::<3>,
        reference::<4>,
        reference::<5>,
    ];
    by_format(&REFS, format)
}

/// The kernel of `format` in a path's kernels in `TensorFormat::INTERLEAVED` order.
pub(super) fn by_format(kernels: &[QDotX8Fn; 6], format: TensorFormat) -> Option<QDotX8Fn> {
    TensorFormat::INTERLEAVED.iter().position(|&f| f == format).map(|i| kernels[i])
}

#[cfg(test)]
mod tests {
    use super::super::{noise, paths, PathKernels};
    use super::*;
    use crate::acts::{ActScheme, Q8Acts};
    use crate::{decode_row_raw, isa, matmul_raw, Isa, WeightRows};

    /// `rows` source rows of `blocks` blocks with every f16 field set to `bits`, or to small
    /// varied normal values when `bits` is None.
    fn source_rows(base: TensorFormat, rows: usize, blocks: usize, bits: Option<u16>) -> Vec<u8> {
        let bytes = base.block_bytes();
        let x8 = base.interleaved_variant().unwrap().interleaved().unwrap();
        let mut data = noise(rows * blocks * bytes, bytes as u64 + rows as u64);
        for (i, blk) in data.chunks_exact_mut(bytes).enumerate() {
            for at in (x8.fields_at..x8.fields_at + x8.fields).step_by(2) {
                let v = bits.unwrap_or_else(|| {
                    half::f16::from_f32(
                        0.01 + 0.001 * (i % 17) as f32 - 0.002 * (at - x8.fields_at) as f32,
                    )
                    .to_bits()
                });
                blk[at..at + 2].copy_from_slice(&v.to_le_bytes());
            }
        }
        data
    }

    fn interleave(format: TensorFormat, data: &[u8], rows: usize) -> Vec<u8> {
        let stride = data.len() / rows;
        (0..rows / INTERLEAVE)
            .flat_map(|g| {
                let r: [&[u8]; INTERLEAVE] =
                    std::array::from_fn(|i| &data[(8 * g + i) * stride..(8 * g + i + 1) * stride]);
                group_of_rows(format, &r)
            })
            .collect()
    }

    /// Every ISA's group kernel, for 1..=8 tokens, equals the row kernel on the rows of `data`
    /// (8 source rows), after they went into a group and back out.
    fn assert_group_matches(format: TensorFormat, data: &[u8], acts: &[Q8Acts], case: &str) {
        let base = format.interleaved().unwrap().base;
        let cols = acts[0].cols;
        let group = interleave(format, data, INTERLEAVE);
        let mut row = Vec::new();
        for lane in 0..INTERLEAVE {
            row_of_group(format, &group, lane, &mut row);
            assert_eq!(row, data[lane * row.len()..(lane + 1) * row.len()]);
        }
        let (one, _) = int_scalar::qdot(base).unwrap();
        for (path, kern) in paths::to_test(|k| k.group_kernel(format).unwrap()) {
            for tokens in 1..=MAX_TOKENS {
                let x: Vec<Q8Row> = acts[..tokens].iter().map(|a| a.row(0)).collect();
                let mut out = vec![[0.0; INTERLEAVE]; tokens];
                kern(&group, &x, &mut out);
                // Each token gets bitwise what it gets alone: a session's result must not
                // depend on the batch it is decoded in.
                for (t, xt) in x.iter().enumerate() {
                    let mut alone = [[0.0; INTERLEAVE]];
                    kern(&group, std::slice::from_ref(xt), &mut alone);
                    assert!(out[t] == alone[0], "{format:?} {path} {case}: token {t} of {tokens}");
                }
                // A pair kernel gives bitwise what the group kernel gives for each group (here
                // the group and its rows reversed).
                if let Some(pair_kern) = paths::to_test(|k| k.pair_kernel(format))
                    .into_iter()
                    .find(|(p, _)| p == &path)
                    .and_then(|(_, k)| k.map(|(k, _)| k))
                {
                    let second = interleave(format, &reversed(data, INTERLEAVE), INTERLEAVE);
                    let mut other = vec![[0.0; INTERLEAVE]; tokens];
                    kern(&second, &x, &mut other);
                    let pair = [group.clone(), second].concat();
                    let mut both = vec![[0.0; 2 * INTERLEAVE]; tokens];
                    pair_kern(&pair, &x, &mut both);
                    for t in 0..tokens {
                        let want = [out[t], other[t]].concat();
                        assert!(both[t][..] == want[..], "{format:?} {path} {case}: pair t={t}");
                    }
                }
                for (t, xt) in x.iter().enumerate() {
                    for lane in 0..INTERLEAVE {
                        let src = &data[lane * row.len()..(lane + 1) * row.len()];
                        let want = one(src, *xt);
                        let mut w = vec![0.0; cols];
                        (PathKernels::of(Isa::Scalar).row_kernels(base).decode)(src, &mut w);
                        let mag: f32 = w
                            .iter()
                            .zip(xt.qs)
                            .enumerate()
                            .map(|(i, (a, &q))| (a * f32::from(q) * xt.ds[i / 32][0]).abs())
                            .sum();
                        let got = out[t][lane];
                        assert!(
                            (got - want).abs() <= 1e-5 * mag + f32::MIN_POSITIVE,
                            "{format:?} {path} {case} t={t} lane={lane}: {got} vs {want}"
                        );
                    }
                }
            }
        }
    }

    /// The `rows` source rows of `data` in reverse order.
    fn reversed(data: &[u8], rows: usize) -> Vec<u8> {
        let len = data.len() / rows;
        data.chunks_exact(len).rev().flatten().copied().collect()
    }

    /// Random blocks, zero blocks, the largest f16 scale and the smallest subnormal one.
    #[test]
    fn group_kernels_match_row_kernels() {
        for format in TensorFormat::INTERLEAVED {
            let base = format.interleaved().unwrap().base;
            let blocks = 7;
            let cols = base.block_len() * blocks;
            let acts: Vec<Q8Acts> = (0..MAX_TOKENS)
                .map(|t| {
                    let x: Vec<f32> = (0..cols)
                        .map(|i| (((i * 7919 + 31 * t) % 251) as f32 - 125.0) / (7.0 + t as f32))
                        .collect();
                    Q8Acts::quantize(&x, cols, ActScheme::for_format(base))
                })
                .collect();
            for bits in [None, Some(0), Some(0x7BFF), Some(0x0001)] {
                let mut data = source_rows(base, INTERLEAVE, blocks, bits);
                if bits == Some(0) {
                    data.fill(0);
                }
                assert_group_matches(format, &data, &acts, &format!("{bits:?}"));
            }
        }
    }

    /// The largest products the integer sums can meet: every quant at its extreme and every
    /// activation at +-127 (AVX2's i16 stage is closest to saturating here).
    #[test]
    fn group_kernels_do_not_saturate() {
        for format in TensorFormat::INTERLEAVED {
            let base = format.interleaved().unwrap().base;
            let x8 = format.interleaved().unwrap();
            let blocks = 3;
            let cols = base.block_len() * blocks;
            // -127 for q8_0's signed bytes; all bits set (the largest unsigned quant) elsewhere.
            let extreme = if base == TensorFormat::Q8_0 { 0x81 } else { 0xFF };
            let mut data = source_rows(base, INTERLEAVE, blocks, None);
            for blk in data.chunks_exact_mut(base.block_bytes()) {
                for (i, byte) in blk.iter_mut().enumerate() {
                    if !(x8.fields_at..x8.fields_at + x8.fields).contains(&i) {
                        *byte = extreme;
                    }
                }
            }
            for sign in [1.0f32, -1.0] {
                let acts: Vec<Q8Acts> = (0..MAX_TOKENS)
                    .map(|_| Q8Acts::quantize(&vec![sign; cols], cols, ActScheme::for_format(base)))
                    .collect();
                assert!(acts[0].qs.iter().all(|q| q.unsigned_abs() == 127));
                assert_group_matches(format, &data, &acts, &format!("extreme, sign {sign}"));
            }
        }
    }

    /// A whole matmul (tokens not a multiple of 4, several threads' worth of groups) and row
    /// decoding give the source format's results.
    #[test]
    fn matmul_and_decode_match_the_source_format() {
        let _serial = isa::test_lock();
        let (rows, tokens) = (64, 7);
        for format in TensorFormat::INTERLEAVED {
            let base = format.interleaved().unwrap().base;
            let cols = 3 * base.block_len();
            let x: Vec<f32> = (0..tokens * cols).map(|i| ((i * 37) % 23) as f32 - 11.0).collect();
            let data = source_rows(base, rows, 3, None);
            let group = interleave(format, &data, rows);
            let plain = WeightRows { format: base, bytes: &data, rows, cols };
            let mixed = WeightRows { format, bytes: &group, rows, cols };
            for path in Isa::available() {
                isa::set_override(path).unwrap();
                let (mut want, mut got) = (vec![0.0; tokens * rows], vec![0.0; tokens * rows]);
                matmul_raw(&x, tokens, plain, &mut want);
                matmul_raw(&x, tokens, mixed, &mut got);
                for (a, b) in want.iter().zip(&got) {
                    assert!((a - b).abs() <= 1e-4 * a.abs().max(1.0), "{format:?} {path:?}");
                }
                let (mut a, mut b) = (vec![0.0; cols], vec![0.0; cols]);
                for r in [0, 5, 8, 63] {
                    decode_row_raw(plain, r, &mut a);
                    decode_row_raw(mixed, r, &mut b);
                    assert_eq!(a, b, "{format:?} row {r}");
                }
            }
        }
        isa::set_override(*Isa::available().last().unwrap()).unwrap();
    }
}
