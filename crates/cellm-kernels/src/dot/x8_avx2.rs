//! Group kernels of the interleaved formats (layout in `x8.rs`) for the AVX2 family: 8 weight
//! rows times up to 4 token rows. Each 32-byte load is 4 quants of every row; the matching 4
//! activation bytes are broadcast, so one byte product step (`bytes::ByteDot`: `vpmaddubsw` +
//! `vpmaddwd`, or VNNI's `vpdpbusd`) leaves one row's partial sum per lane, and the block
//! scales apply to 8 rows in one multiply.

use std::arch::x86_64::*;

use cellm_format::{TensorFormat, INTERLEAVE};

use super::bytes::{self, Avx2, Avx512Vnni, AvxVnni, ByteDot};
use super::prefetch;
use super::x8::{self, check_group_args, QDotX16Fn, QDotX8Fn};
use crate::acts::Q8Row;

/// Activation bytes `4v..4v + 4` of block `b`, in every 32-bit lane.
#[inline(always)]
unsafe fn broadcast4(x: &Q8Row, b: usize, v: usize) -> __m256i {
    _mm256_set1_epi32(x.qs.as_ptr().add(32 * b + 4 * v).cast::<i32>().read_unaligned())
}

/// Byte `byte` (0..4) of each lane's 32-bit word, copied to all 4 bytes of the lane.
#[inline(always)]
unsafe fn lane_byte(v: __m256i, byte: i8) -> __m256i {
    let starts = _mm256_setr_epi8(
        0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12, 0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12,
        12, 12, 12,
    );
    _mm256_shuffle_epi8(v, _mm256_add_epi8(starts, _mm256_set1_epi8(byte)))
}

/// 16 in byte `j` of each lane where bit `first + j` of the lane's word is set (`first` a
/// multiple of 4): q5_0's fifth bits for 4 consecutive elements of each row.
#[inline(always)]
unsafe fn fifth_bits(qh: __m256i, first: usize) -> __m256i {
    let bits = _mm256_set1_epi32(if first.is_multiple_of(8) {
        0x0804_0201
    } else {
        0x8040_2010u32 as i32
    });
    let set = _mm256_cmpeq_epi8(_mm256_and_si256(lane_byte(qh, (first / 8) as i8), bits), bits);
    _mm256_and_si256(set, _mm256_set1_epi8(16))
}

/// The unsigned 32-value formats, `KIND` 0, 1, 2 = q4_0x8 (`c = -8d`), q4_1x8 (`c = m`),
/// q5_0x8 (`c = -16d`, a fifth bit per quant from `qh`): quants `u` with value `d * u + c`, so
/// a block contributes `d * dx * sum(u * x) + c * s` (`s = dx * sum(x)`, from the activations).
#[inline(always)]
unsafe fn unsigned_x8<D: ByteDot, const N: usize, const KIND: u8>(
    group: &[u8],
    x: &[Q8Row; N],
) -> [__m256; N] {
    let five = KIND == 2;
    // f16 fields (8 rows x 1 or 2), then q5_0's 8 qh words, then 4 chunks of nibbles.
    let head = if KIND == 1 { 32 } else { 16 } + if five { 32 } else { 0 };
    let bytes = head + 128;
    // A chunk adds two products (low and high nibbles) of quants up to 15 or 31.
    let per_run = D::run_chunks(if five { 62 } else { 30 }, 4);
    let low = _mm256_set1_epi8(0x0F);
    let mut acc = [_mm256_setzero_ps(); N];
    let base = group.as_ptr();
    for b in 0..group.len() / bytes {
        let blk = base.add(bytes * b);
        prefetch::column_ahead(blk, bytes);
        let d = _mm256_cvtph_ps(_mm_loadu_si128(blk.cast()));
        let c = match KIND {
            0 => _mm256_mul_ps(d, _mm256_set1_ps(-8.0)),
            1 => _mm256_cvtph_ps(_mm_loadu_si128(blk.add(16).cast())),
            _ => _mm256_mul_ps(d, _mm256_set1_ps(-16.0)),
        };
        let qh = if five { _mm256_loadu_si256(blk.add(16).cast()) } else { _mm256_setzero_si256() };
        let qs = blk.add(head);
        let mut sums = [_mm256_setzero_si256(); N];
        for first in (0..4).step_by(per_run) {
            let mut run = [_mm256_setzero_si256(); N];
            for chunk in first..first + per_run {
                let q = _mm256_loadu_si256(qs.add(32 * chunk).cast());
                // Low nibbles are values 4c..4c+4 of each row, high nibbles values 16 + 4c...
                let mut lo = _mm256_and_si256(q, low);
                let mut hi = _mm256_and_si256(_mm256_srli_epi16::<4>(q), low);
                if five {
                    lo = _mm256_or_si256(lo, fifth_bits(qh, 4 * chunk));
                    hi = _mm256_or_si256(hi, fifth_bits(qh, 16 + 4 * chunk));
                }
                for t in 0..N {
                    run[t] = D::step(run[t], lo, broadcast4(&x[t], b, chunk));
                    run[t] = D::step(run[t], hi, broadcast4(&x[t], b, chunk + 4));
                }
            }
            for t in 0..N {
                sums[t] = _mm256_add_epi32(sums[t], D::widen(run[t]));
            }
        }
        for t in 0..N {
            let [dx, sx] = x[t].ds[b];
            let p = _mm256_cvtepi32_ps(sums[t]);
            acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(dx)), p, acc[t]);
            acc[t] = _mm256_fmadd_ps(c, _mm256_set1_ps(sx), acc[t]);
        }
    }
    acc
}

/// Byte `j` (0..4) of each lane as an i16 in both halves of the lane: a per-row multiplier
/// for `vpmaddwd`.
#[inline(always)]
unsafe fn lane_scale(v: __m256i, j: i8) -> __m256i {
    let z = -128; // a shuffle index with the top bit set yields 0
    let starts = _mm256_setr_epi8(
        0, z, 0, z, 4, z, 4, z, 8, z, 8, z, 12, z, 12, z, 0, z, 0, z, 4, z, 4, z, 8, z, 8, z, 12,
        z, 12, z,
    );
    let pick = _mm256_add_epi8(
        starts,
        _mm256_and_si256(_mm256_set1_epi16(i16::from(j)), _mm256_set1_epi16(0xFF)),
    );
    _mm256_shuffle_epi8(v, pick)
}

/// The top two bits of every byte, moved to bits 4 and 5.
#[inline(always)]
unsafe fn top2_to_4(v: __m256i) -> __m256i {
    _mm256_slli_epi16::<4>(_mm256_and_si256(_mm256_srli_epi16::<6>(v), _mm256_set1_epi8(3)))
}

/// q4_kx8: super-blocks of 256 in 8 sub-blocks with 6-bit scales `sc` and mins `m` (packed
/// per row in 12 bytes: chunks 0..3 of the column), value `d * sc * u - dmin * m`. The
/// activations (Q8K) share one scale per super-block, so the sub-blocks' integer sums are
/// weighted by `sc` as integers and converted once.
#[inline(always)]
unsafe fn q4_k_x8<D: ByteDot, const N: usize>(group: &[u8], x: &[Q8Row; N]) -> [__m256; N] {
    let bytes = 8 * 144;
    let (low, six) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi8(63));
    let mut acc = [_mm256_setzero_ps(); N];
    let base = group.as_ptr();
    for b in 0..group.len() / bytes {
        let blk = base.add(bytes * b);
        let d = _mm256_cvtph_ps(_mm_loadu_si128(blk.cast()));
        let dmin = _mm256_cvtph_ps(_mm_loadu_si128(blk.add(16).cast()));
        // Per lane, bytes j of scale/min words 0 and 1 are sub-blocks j and 4 + j.
        let packed = [0, 1, 2].map(|i| _mm256_loadu_si256(blk.add(32 + 32 * i).cast()));
        let scales = [
            _mm256_and_si256(packed[0], six),
            _mm256_or_si256(_mm256_and_si256(packed[2], low), top2_to_4(packed[0])),
        ];
        let mins = [
            _mm256_and_si256(packed[1], six),
            _mm256_or_si256(
                _mm256_and_si256(_mm256_srli_epi16::<4>(packed[2]), low),
                top2_to_4(packed[1]),
            ),
        ];
        let qs = blk.add(128);
        let mut sums = [_mm256_setzero_si256(); N];
        // Eight chunks of u4 x i8 products (a sub-block) fit one AVX2 run, as in q4_0x8.
        debug_assert_eq!(D::run_chunks(15, 8), 8);
        for pair in 0..4 {
            // A quarter of the column's prefetches per pair, not a burst of 19 up front:
            // Llama-3.2-1B Q4_K_M decode 16.7-17.3 -> 18.0-18.3 tok/s (medians of 6 and 8
            // alternating runs), though `gemv` alone had preferred the burst.
            prefetch::column_ahead_part(blk, bytes, pair, 4);
            let (mut lo_sums, mut hi_sums) =
                ([_mm256_setzero_si256(); N], [_mm256_setzero_si256(); N]);
            for chunk in 0..8 {
                let q = _mm256_loadu_si256(qs.add(32 * (8 * pair + chunk)).cast());
                let lo = _mm256_and_si256(q, low);
                let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(q), low);
                for t in 0..N {
                    let xl = broadcast4(&x[t], 8 * b + 2 * pair, chunk);
                    let xh = broadcast4(&x[t], 8 * b + 2 * pair + 1, chunk);
                    lo_sums[t] = D::step(lo_sums[t], lo, xl);
                    hi_sums[t] = D::step(hi_sums[t], hi, xh);
                }
            }
            let (j_lo, j_hi) = (2 * pair, 2 * pair + 1);
            let sc_lo = lane_scale(scales[j_lo / 4], (j_lo % 4) as i8);
            let sc_hi = lane_scale(scales[j_hi / 4], (j_hi % 4) as i8);
            for t in 0..N {
                let p = _mm256_add_epi32(
                    D::widen_times(lo_sums[t], sc_lo),
                    D::widen_times(hi_sums[t], sc_hi),
                );
                sums[t] = _mm256_add_epi32(sums[t], p);
            }
        }
        // dmin * m_j per row, for the activation sums of each sub-block.
        let mins_f: [__m256; 8] = std::array::from_fn(|j| {
            let byte = _mm256_srlv_epi32(mins[j / 4], _mm256_set1_epi32(8 * (j % 4) as i32));
            let m = _mm256_and_si256(byte, _mm256_set1_epi32(0xFF));
            _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(m))
        });
        for t in 0..N {
            let ds = &x[t].ds[8 * b..8 * b + 8];
            let scale = _mm256_mul_ps(d, _mm256_set1_ps(ds[0][0]));
            acc[t] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(sums[t]), acc[t]);
            for (m, ds) in mins_f.iter().zip(ds) {
                acc[t] = _mm256_fnmadd_ps(*m, _mm256_set1_ps(ds[1]), acc[t]);
            }
        }
    }
    acc
}

/// q6_kx8: super-blocks of 256 in 16 sub-blocks of 16 with signed 8-bit scales, value
/// `d * sc * (q - 32)` for 6-bit `q` (4 bits from `ql`, 2 from `qh`). Column layout: `d` of
/// the 8 rows, then 32 chunks of `ql`, 16 of `qh`, 4 of scales. VNNI multiplies the unsigned
/// `q` and takes the offset off once per sub-block, as `32 * sc` times the activations' sum
/// over it (`Q8Row::sums16`). AVX2 subtracts `32 * x` from every product instead: the offset
/// trick would need its i16 sums widened twice as often, which costs more than it saves.
#[inline(always)]
unsafe fn q6_k_x8<D: ByteDot, const N: usize>(group: &[u8], x: &[Q8Row; N]) -> [__m256; N] {
    let bytes = 8 * 210;
    let mut acc = [_mm256_setzero_ps(); N];
    let base = group.as_ptr();
    for b in 0..group.len() / bytes {
        let blk = base.add(bytes * b);
        let d = _mm256_cvtph_ps(_mm_loadu_si128(blk.cast()));
        let mut sums = [_mm256_setzero_si256(); N];
        for half in 0..2 {
            for quarter in 0..2 {
                let at = Q6Quarter { blk, b, half, quarter };
                at.add::<D, N, 0>(x, &mut sums);
                at.add::<D, N, 1>(x, &mut sums);
                at.add::<D, N, 2>(x, &mut sums);
                at.add::<D, N, 3>(x, &mut sums);
            }
        }
        for t in 0..N {
            let scale = _mm256_mul_ps(d, _mm256_set1_ps(x[t].ds[8 * b][0]));
            acc[t] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(sums[t]), acc[t]);
        }
    }
    acc
}

/// Elements `32k + l`, `l` in `16 * quarter..+16`, of half `half` of a q6_kx8 column: the
/// 16-element sub-block `8 * half + 2k + quarter` of each row, in 4 chunks `i`. Its quants
/// are nibble `k / 2` of `ql` chunk `16 * half + 8 * (k % 2) + i` with bits `2k..2k+2` of
/// `qh` chunk `32 + 8 * half + i`; its scale is byte `2 * (k % 2) + quarter` of scale chunk
/// `48 + 2 * half + k / 2`. One sub-block at a time keeps one running sum per token live:
/// four at once fill the 16 registers with 4 tokens' sums, and spill.
struct Q6Quarter {
    blk: *const u8,
    b: usize,
    half: usize,
    quarter: usize,
}

impl Q6Quarter {
    /// `sums[t] += sc * sum(q * x[t])` over the sub-block, for `(q - 32)` in AVX2's case.
    #[inline(always)]
    unsafe fn add<D: ByteDot, const N: usize, const K: usize>(
        &self,
        x: &[Q8Row; N],
        sums: &mut [__m256i; N],
    ) {
        const SIZE: usize = 8 * 210;
        let Self { blk, b, half, quarter } = *self;
        let chunk = |c: usize| _mm256_loadu_si256(blk.add(16 + 32 * c).cast());
        let low = _mm256_set1_epi8(0x0F);
        // A sub-block (4 chunks) is one run: AVX2 sums four (q - 32) x i8 pair sums per i16
        // lane, within 4 * 8128 = 32512.
        let mut run = [_mm256_setzero_si256(); N];
        for i in 4 * quarter..4 * quarter + 4 {
            if K == 0 {
                // Spread over the column: q6_k's 27-line burst halved its streaming rate
                // (`gemv 32768 4096`, 2 threads: 8.6-11.8 -> 14.2-18.7 GB/s).
                prefetch::column_ahead_part(blk, SIZE, 8 * half + i, 16);
            }
            let ql = chunk(16 * half + 8 * (K % 2) + i);
            let nibbles = if K < 2 { ql } else { _mm256_srli_epi16::<4>(ql) };
            // Bits 2K..2K+2 of each byte of `qh` moved to bits 4..6 (16-bit shifts: what
            // crosses into a neighbouring byte is masked off).
            let qh = chunk(32 + 8 * half + i);
            let moved = match K {
                0 => _mm256_slli_epi16::<4>(qh),
                1 => _mm256_slli_epi16::<2>(qh),
                2 => qh,
                _ => _mm256_srli_epi16::<2>(qh),
            };
            let q = _mm256_or_si256(
                _mm256_and_si256(nibbles, low),
                _mm256_and_si256(moved, _mm256_set1_epi8(0x30)),
            );
            for t in 0..N {
                let xv = broadcast4(&x[t], 8 * b + 4 * half + K, i);
                run[t] = if D::NARROW {
                    let p = _mm256_sub_epi16(
                        _mm256_maddubs_epi16(q, xv),
                        _mm256_maddubs_epi16(_mm256_set1_epi8(32), xv),
                    );
                    _mm256_add_epi16(run[t], p)
                } else {
                    D::step(run[t], q, xv)
                };
            }
        }
        let sc = signed_lane_scale(chunk(48 + 2 * half + K / 2), (2 * (K % 2) + quarter) as i8);
        for t in 0..N {
            sums[t] = _mm256_add_epi32(sums[t], D::widen_times(run[t], sc));
            if !D::NARROW {
                // |16 * sum| <= 16 * 16 * 127 fits i16; vpmaddwd adds the two halves, which
                // both hold sc: sc * -32 * sum.
                let sum = x[t].sums16[16 * b + 8 * half + 2 * K + quarter];
                let offset = _mm256_madd_epi16(sc, _mm256_set1_epi16(-16 * sum));
                sums[t] = _mm256_add_epi32(sums[t], offset);
            }
        }
    }
}

/// Signed byte `j` (0..4) of each lane, sign-extended to i16 in both halves of the lane.
#[inline(always)]
unsafe fn signed_lane_scale(v: __m256i, j: i8) -> __m256i {
    // The byte lands in the high half of each i16; an arithmetic shift brings it down.
    let z = -128;
    let starts = _mm256_setr_epi8(
        z, 0, z, 0, z, 4, z, 4, z, 8, z, 8, z, 12, z, 12, z, 0, z, 0, z, 4, z, 4, z, 8, z, 8, z,
        12, z, 12,
    );
    let offset = _mm256_set1_epi16(i16::from(j) << 8);
    _mm256_srai_epi16::<8>(_mm256_shuffle_epi8(v, _mm256_add_epi8(starts, offset)))
}

/// q8_0x8: signed quants, multiplied as |w| times x carrying w's sign.
#[inline(always)]
unsafe fn q8_0_x8<D: ByteDot, const N: usize>(group: &[u8], x: &[Q8Row; N]) -> [__m256; N] {
    let bytes = 16 + 256;
    let per_run = D::run_chunks(127, 8);
    let mut acc = [_mm256_setzero_ps(); N];
    let base = group.as_ptr();
    for b in 0..group.len() / bytes {
        let blk = base.add(bytes * b);
        prefetch::column_ahead(blk, bytes);
        let d = _mm256_cvtph_ps(_mm_loadu_si128(blk.cast()));
        let qs = blk.add(16);
        let mut sums = [_mm256_setzero_si256(); N];
        for first in (0..8).step_by(per_run) {
            let mut run = [_mm256_setzero_si256(); N];
            for chunk in first..first + per_run {
                let w = _mm256_loadu_si256(qs.add(32 * chunk).cast());
                let wabs = _mm256_sign_epi8(w, w);
                for t in 0..N {
                    let xs = _mm256_sign_epi8(broadcast4(&x[t], b, chunk), w);
                    run[t] = D::step(run[t], wabs, xs);
                }
            }
            for t in 0..N {
                sums[t] = _mm256_add_epi32(sums[t], D::widen(run[t]));
            }
        }
        for t in 0..N {
            let scale = _mm256_mul_ps(d, _mm256_set1_ps(x[t].ds[b][0]));
            acc[t] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(sums[t]), acc[t]);
        }
    }
    acc
}

/// The group product of format `F` (index into `TensorFormat::INTERLEAVED`) on path `D`.
#[inline(always)]
unsafe fn body<D: ByteDot, const N: usize, const F: usize>(
    group: &[u8],
    x: &[Q8Row],
    out: &mut [[f32; INTERLEAVE]],
) {
    let x: &[Q8Row; N] = x.try_into().expect("N activation rows");
    let acc = match F {
        0 => q8_0_x8::<D, N>(group, x),
        1 => unsigned_x8::<D, N, 0>(group, x),
        2 => unsigned_x8::<D, N, 1>(group, x),
        3 => unsigned_x8::<D, N, 2>(group, x),
        4 => q4_k_x8::<D, N>(group, x),
        _ => q6_k_x8::<D, N>(group, x),
    };
    for (o, a) in out.iter_mut().zip(acc) {
        _mm256_storeu_ps(o.as_mut_ptr(), a);
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn run_avx2<const N: usize, const F: usize>(g: &[u8], x: &[Q8Row], o: &mut [[f32; 8]]) {
    body::<Avx2, N, F>(g, x, o)
}

#[target_feature(enable = "avx2,fma,f16c,avxvnni")]
unsafe fn run_avx_vnni<const N: usize, const F: usize>(g: &[u8], x: &[Q8Row], o: &mut [[f32; 8]]) {
    body::<AvxVnni, N, F>(g, x, o)
}

#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
unsafe fn run_avx512_vnni<const N: usize, const F: usize>(
    g: &[u8],
    x: &[Q8Row],
    o: &mut [[f32; 8]],
) {
    body::<Avx512Vnni, N, F>(g, x, o)
}

#[cfg(test)]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn run_emulated_vnni<const N: usize, const F: usize>(
    g: &[u8],
    x: &[Q8Row],
    o: &mut [[f32; 8]],
) {
    body::<bytes::EmulatedVnni, N, F>(g, x, o)
}

/// `N` tokens of format `F` on path `P` (`bytes::AVX2`...).
unsafe fn run<const P: u8, const N: usize, const F: usize>(
    group: &[u8],
    x: &[Q8Row],
    out: &mut [[f32; INTERLEAVE]],
) {
    match P {
        bytes::AVX2 => run_avx2::<N, F>(group, x, out),
        bytes::AVX_VNNI => run_avx_vnni::<N, F>(group, x, out),
        #[cfg(test)]
        bytes::EMULATED_VNNI => run_emulated_vnni::<N, F>(group, x, out),
        _ => run_avx512_vnni::<N, F>(group, x, out),
    }
}

/// Format `F` (index into `TensorFormat::INTERLEAVED`) on path `P` for 1..=8 tokens.
fn entry<const P: u8, const F: usize>(group: &[u8], x: &[Q8Row], out: &mut [[f32; INTERLEAVE]]) {
    // AVX2's q6_k kernel takes its offset off with the activations' sums of 16.
    check_group_args(TensorFormat::INTERLEAVED[F], group, x, out.len(), F == 5);
    // SAFETY: only the path tables hand this out, and `PathKernels::of` checks the path's CPU
    // features; loads stay inside the group and the activation rows checked above.
    unsafe {
        match x.len() {
            1 => run::<P, 1, F>(group, x, out),
            2 => run::<P, 2, F>(group, x, out),
            3 => run::<P, 3, F>(group, x, out),
            4 => run::<P, 4, F>(group, x, out),
            // AVX-512's 32 registers hold 8 tokens' sums: each weight block is unpacked once
            // for all of them. The 16-register paths take them 4 at a time.
            n @ 5..=8 if P == bytes::AVX512_VNNI => match n {
                5 => run::<P, 5, F>(group, x, out),
                6 => run::<P, 6, F>(group, x, out),
                7 => run::<P, 7, F>(group, x, out),
                _ => run::<P, 8, F>(group, x, out),
            },
            5..=8 => {
                let (xa, xb) = x.split_at(4);
                let (oa, ob) = out.split_at_mut(4);
                entry::<P, F>(group, xa, oa);
                entry::<P, F>(group, xb, ob);
            }
            n => panic!("group kernels take 1..=8 tokens, got {n}"),
        }
    }
}

// Pair kernels (AVX-512 VNNI): two neighbouring groups, 16 rows, per 512-bit vector. One
// `vpdpbusd` then multiplies 4 quants of 16 rows by a token's 4 broadcast activation bytes,
// where the group kernels above issue two 256-bit ones for two calls; the unpacking and the
// broadcasts are shared the same way. Each row's integer sums are the group kernel's, and
// its scales apply in the same float operations, so every output is bitwise what the group
// kernel gives (a session's logits do not depend on which kernel its rows went through).

/// The 32-byte chunk at `at` of the first group and the one `stride` later, of the second.
#[inline(always)]
unsafe fn load_pair(at: *const u8, stride: usize) -> __m512i {
    let a = _mm256_loadu_si256(at.cast());
    let b = _mm256_loadu_si256(at.add(stride).cast());
    _mm512_inserti64x4::<1>(_mm512_castsi256_si512(a), b)
}

/// The 8 f16 fields at `at` (first group's rows) and `stride` later (second's), as f32.
#[inline(always)]
unsafe fn halves_ph(at: *const u8, stride: usize) -> __m512 {
    let a = _mm_loadu_si128(at.cast());
    let b = _mm_loadu_si128(at.add(stride).cast());
    _mm512_cvtph_ps(_mm256_inserti128_si256::<1>(_mm256_castsi128_si256(a), b))
}

/// Activation bytes `4v..4v + 4` of block `b`, in every 32-bit lane of a 512-bit vector.
#[inline(always)]
unsafe fn broadcast4_x16(x: &Q8Row, b: usize, v: usize) -> __m512i {
    _mm512_set1_epi32(x.qs.as_ptr().add(32 * b + 4 * v).cast::<i32>().read_unaligned())
}

/// [`unsigned_x8`] (q4_0x8 `KIND` 0, q4_1x8 `KIND` 1) for the two groups of `pair`.
#[inline(always)]
unsafe fn unsigned_x16<const N: usize, const KIND: u8>(pair: &[u8], x: &[Q8Row; N]) -> [__m512; N] {
    let stride = pair.len() / 2;
    let head = if KIND == 1 { 32 } else { 16 };
    let bytes = head + 128;
    let low = _mm512_set1_epi8(0x0F);
    let mut acc = [_mm512_setzero_ps(); N];
    let base = pair.as_ptr();
    for b in 0..stride / bytes {
        let blk = base.add(bytes * b);
        // At 8 tokens this kernel is compute-bound: its requests go into L1 (see
        // `prefetch::PAIR_L2_BYTES`).
        if N < x8::MAX_TOKENS {
            prefetch::pair_ahead::<{ prefetch::INTO_L2 }>(blk, bytes * b, bytes, stride);
        } else {
            prefetch::pair_ahead::<{ prefetch::INTO_L1 }>(blk, bytes * b, bytes, stride);
        }
        let d = halves_ph(blk, stride);
        let c = match KIND {
            0 => _mm512_mul_ps(d, _mm512_set1_ps(-8.0)),
            _ => halves_ph(blk.add(16), stride),
        };
        let qs = blk.add(head);
        let mut run = [_mm512_setzero_si512(); N];
        for chunk in 0..4 {
            let q = load_pair(qs.add(32 * chunk), stride);
            let lo = _mm512_and_si512(q, low);
            let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(q), low);
            for t in 0..N {
                run[t] = _mm512_dpbusd_epi32(run[t], lo, broadcast4_x16(&x[t], b, chunk));
                run[t] = _mm512_dpbusd_epi32(run[t], hi, broadcast4_x16(&x[t], b, chunk + 4));
            }
        }
        for t in 0..N {
            let [dx, sx] = x[t].ds[b];
            let p = _mm512_cvtepi32_ps(run[t]);
            acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(dx)), p, acc[t]);
            acc[t] = _mm512_fmadd_ps(c, _mm512_set1_ps(sx), acc[t]);
        }
    }
    acc
}

/// [`q8_0_x8`] for the two groups of `pair`. AVX-512 has no `vpsignb`: the signed quants
/// `w` go in as the bytes `w + 128` (`w ^ 0x80`, once for every token), and each block's sum
/// takes off `128 * sum(x)` (the activations' integer block sum): the same integer as the
/// group kernel's `|w| * (x signed by w)` sums, with one instruction less per token and chunk.
#[inline(always)]
unsafe fn q8_0_x16<const N: usize>(pair: &[u8], x: &[Q8Row; N]) -> [__m512; N] {
    let stride = pair.len() / 2;
    let bytes = 16 + 256;
    let flip = _mm512_set1_epi8(-128);
    let mut acc = [_mm512_setzero_ps(); N];
    let base = pair.as_ptr();
    for b in 0..stride / bytes {
        let blk = base.add(bytes * b);
        prefetch::pair_ahead::<{ prefetch::INTO_L2 }>(blk, bytes * b, bytes, stride);
        let d = halves_ph(blk, stride);
        let qs = blk.add(16);
        let mut run = [_mm512_setzero_si512(); N];
        for chunk in 0..8 {
            let u = _mm512_xor_si512(load_pair(qs.add(32 * chunk), stride), flip);
            for t in 0..N {
                run[t] = _mm512_dpbusd_epi32(run[t], u, broadcast4_x16(&x[t], b, chunk));
            }
        }
        for t in 0..N {
            let offset = _mm512_set1_epi32(128 * i32::from(x[t].sums32[b]));
            let sum = _mm512_sub_epi32(run[t], offset);
            let scale = _mm512_mul_ps(d, _mm512_set1_ps(x[t].ds[b][0]));
            acc[t] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(sum), acc[t]);
        }
    }
    acc
}

#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn run_pair<const N: usize, const F: usize>(
    pair: &[u8],
    x: &[Q8Row],
    out: &mut [[f32; 2 * INTERLEAVE]],
) {
    let x: &[Q8Row; N] = x.try_into().expect("N activation rows");
    let acc = match F {
        0 => q8_0_x16::<N>(pair, x),
        1 => unsigned_x16::<N, 0>(pair, x),
        _ => unsigned_x16::<N, 1>(pair, x),
    };
    for (o, a) in out.iter_mut().zip(acc) {
        _mm512_storeu_ps(o.as_mut_ptr(), a);
    }
}

/// The pair kernel of format `F` (q8_0x8, q4_0x8, q4_1x8) for 1..=8 tokens.
fn pair_entry<const F: usize>(pair: &[u8], x: &[Q8Row], out: &mut [[f32; 2 * INTERLEAVE]]) {
    let format = TensorFormat::INTERLEAVED[F];
    let (a, b) = pair.split_at(pair.len() / 2);
    check_group_args(format, a, x, out.len(), false);
    assert!(a.len() == b.len(), "{format:?} pair kernel: groups of unequal size");
    if F == 0 {
        let blocks =
            a.len() / (INTERLEAVE * format.interleaved().expect("interleaved").base.block_bytes());
        assert!(
            x.iter().all(|r| r.sums32.len() >= blocks),
            "the activations' block sums are missing"
        );
    }
    // SAFETY: only `pair_qdot` hands this out, on the AVX-512 VNNI path, whose table
    // `PathKernels::of` gives out only after checking the CPU; loads stay inside the two
    // groups (each checked above) and the activation rows.
    unsafe {
        match x.len() {
            1 => run_pair::<1, F>(pair, x, out),
            2 => run_pair::<2, F>(pair, x, out),
            3 => run_pair::<3, F>(pair, x, out),
            4 => run_pair::<4, F>(pair, x, out),
            5 => run_pair::<5, F>(pair, x, out),
            6 => run_pair::<6, F>(pair, x, out),
            7 => run_pair::<7, F>(pair, x, out),
            8 => run_pair::<8, F>(pair, x, out),
            n => panic!("pair kernels take 1..=8 tokens, got {n}"),
        }
    }
}

/// The pair kernel of `format` on path `P` (AVX-512 VNNI's, for q8_0x8, q4_0x8 and q4_1x8),
/// with the fewest tokens it should take. On matrices that stay in cache the pair kernel is
/// 1.3-2.3x faster from one token; streamed from memory it reads two streams a thread, and
/// there the group kernel keeps up at few tokens. An earlier VM (`gemv`, one thread) had
/// q4_1's pair kernel at 1.1x at 2 tokens, 1.4x at 4 and 2.0x at 8, and q8_0's at 1.2x at 4;
/// on session 32's Zen 4, a SmolLM2 Q4_1 step with q4_1's pair kernel from 2 tokens took
/// 1.08-1.27x the group kernel's at 2 sessions and 1.04-1.14x at 3, and 0.96-0.99x at 4
/// (steps alternated in one engine), so q4_1 takes it from 4 tokens, and so does q4_0 (the
/// same kernel less the min term; `gemv` streamed favoured its group kernel at 2-4 tokens).
pub(super) fn pair_qdot<const P: u8>(format: TensorFormat) -> Option<(QDotX16Fn, usize)> {
    if P != bytes::AVX512_VNNI {
        return None;
    }
    const PAIRS: [(TensorFormat, QDotX16Fn, usize); 3] = [
        (TensorFormat::INTERLEAVED[0], pair_entry::<0>, 4),
        (TensorFormat::INTERLEAVED[1], pair_entry::<1>, 4),
        (TensorFormat::INTERLEAVED[2], pair_entry::<2>, 4),
    ];
    PAIRS.iter().find(|(f, ..)| *f == format).map(|&(_, k, min)| (k, min))
}

/// The entries of one path, in `TensorFormat::INTERLEAVED` order.
const fn entries<const P: u8>() -> [QDotX8Fn; 6] {
    [entry::<P, 0>, entry::<P, 1>, entry::<P, 2>, entry::<P, 3>, entry::<P, 4>, entry::<P, 5>]
}

/// The group kernel of `format` on path `P`. Only the path tables (`paths`) hand it out, after
/// checking the CPU.
pub(super) fn qdot<const P: u8>(format: TensorFormat) -> Option<QDotX8Fn> {
    x8::by_format(&entries::<P>(), format)
}
