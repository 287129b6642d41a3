//! How cached keys and values are stored, and how attention reads them back.

use cellm_format::{Error, Result, TensorFormat};
use cellm_kernels::dot::{DecodeFn, HeadKernels, PathKernels};
use cellm_kernels::kv_rows::{self, KvCodes};

use crate::rotation::Rotation;

/// The storage of one cached row (one kv head of one position).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvEncoding {
    F16,
    F32,
    /// int8 with an f16 scale per position and kv head (`kv_rows`), after a fixed Hadamard
    /// rotation per head (`rotation`); keys stored against the page's reference key (a
    /// [`KeyHeader`] without per-channel scales).
    Int8,
    /// 4-bit groups of 16 with a scale byte each, on levels spaced for Gaussian values
    /// (`kv_rows`), after the same rotation. Keys are stored
    /// against a header per page and kv head ([`KeyHeader`]: a reference key and a scale per
    /// channel), which the rotation and the groups then see without the keys' large
    /// per-channel offsets and swings.
    Int4,
}

/// What attention's row path runs over a page's rows of one kv head.
/// The key header of one kv head in one page of a 4-bit cache: keys share large per-channel
/// offsets (Qwen2.5's k bias, the means every model's keys carry) and some channels swing
/// far more than others (a biased pair of dimensions that RoPE turns by a radian a
/// position), which would otherwise set every group's scale once the rotation spreads them.
/// So a page stores each key `k` (unrotated, as the model gives it) as
/// `R ((k - ref) / s)` in 4 bits, where
/// - `ref` is the page's first key, stored as a q4_0 row (unrotated; `kv_rows`),
/// - `s` is a power of two per channel (4 bits each: `s = 2^-e`, `e` at most
///   [`KeyHeader::MAX_EXP`]): how far the previous page's keys strayed from `ref` in that
///   channel, relative to the widest channel (1 for the first page of a session, which has
///   no previous page, or where a sliding layer let the previous page go).
///
/// With 64-dimension heads and pages of 16 the header adds 68 bytes a page (4.25 a
/// position) to the 36-byte key row: keys and values take 0.298x of f16.
///
/// Both depend only on the page's first key and the previous page, so a page holds the same
/// bytes however its session was split into steps, and a shared prefix page is the same for
/// every session. Attention reads `q . k = q . ref + (R (s * q)) . stored`: the query turns
/// once per page, not every key.
pub(crate) struct KeyHeader;

impl KeyHeader {
    /// The largest exponent of a channel's scale: a channel is amplified at most 2^6 times,
    /// so one that strays much further than it did on the previous page cannot swamp the
    /// others (measured: 15 gave Qwen2.5 +4.8% perplexity, 6 gave +3.1%, 3 gave +9%).
    const MAX_EXP: u8 = 6;

    /// Bytes of a header: the reference, and the scales where keys are `scaled` (int4; an
    /// int8 cache keeps the reference alone, all scales 1).
    pub(crate) fn bytes(hd: usize, scaled: bool) -> usize {
        kv_rows::q4_0_row_bytes(hd) + if scaled { hd.div_ceil(2) } else { 0 }
    }

    /// Writes the header of a page whose first key is `k0`, given the previous page's keys
    /// as decoded (`prev`, `rows x hd`; empty for a session's first page) and how strongly
    /// the queries read each channel (`importance`, see [`Self::importance`]; empty: the
    /// scales follow the keys alone), and returns its reference and scales decoded.
    ///
    /// A channel's scale: what matters of a key's error is `q . (stored - k)`, and with
    /// the rotation every channel of the stored row carries about the same error, so a
    /// channel amplified by `w` before rounding comes back with `1 / w` of it, at the cost of
    /// widening the row's range by its share `w * spread`. Minimising
    /// `sum_c (q_c / w_c)^2 * sum_c (w_c spread_c)^2` gives `w_c^2 ~ |q_c| / spread_c`
    /// (Cauchy-Schwarz), so `w_c = sqrt(importance_c / spread_c)`, rounded to a power of two
    /// relative to the smallest. On a session's first page, which has no previous page,
    /// every spread counts as 1 (the queries alone choose). Without importances the scales
    /// equalise the spreads, `w_c = 1 / spread_c` (and are 1 on a first page).
    pub(crate) fn encode(
        k0: &[f32],
        prev: &[f32],
        importance: &[f32],
        header: &mut [u8],
    ) -> (Vec<f32>, Vec<f32>) {
        let hd = k0.len();
        let (codes, exps) = header.split_at_mut(kv_rows::q4_0_row_bytes(hd));
        kv_rows::encode_q4_0(k0, codes);
        let mut reference = vec![0.0; hd];
        kv_rows::decode_q4_0(codes, &mut reference);
        // Per channel, the inverse of its amplification (up to a common factor).
        let mut spread = vec![0.0f32; hd];
        for row in prev.chunks_exact(hd) {
            for ((s, v), r) in spread.iter_mut().zip(row).zip(&reference) {
                *s = s.max((v - r).abs());
            }
        }
        let top_importance = importance.iter().fold(0.0f32, |m, &i| m.max(i));
        if top_importance > 0.0 {
            if prev.is_empty() {
                spread.fill(1.0);
            }
            let floor = top_importance * 1e-6;
            for (s, &i) in spread.iter_mut().zip(importance) {
                *s = if *s > 0.0 { (*s / i.max(floor)).sqrt() } else { 0.0 };
            }
        }
        let top = spread.iter().fold(0.0f32, |m, &s| m.max(s));
        exps.fill(0);
        if top > 0.0 && !exps.is_empty() {
            for (c, &s) in spread.iter().enumerate() {
                let e = if s > 0.0 { (top / s).log2().round() } else { f32::INFINITY };
                let e = e.clamp(0.0, Self::MAX_EXP as f32) as u8;
                exps[c / 2] |= e << (4 * (c % 2));
            }
        }
        (reference, Self::scales(exps, hd))
    }

    /// How strongly the queries of one position read each channel of the kv head they share
    /// (`q`: those query heads, `hd` each): per channel, the root mean square over the heads
    /// of the norm of its RoPE pair (`c` and `c + hd / 2`, rotate-half), which the position's
    /// rotation leaves alone. Empty for an empty `q`.
    pub(crate) fn importance(q: &[f32], hd: usize) -> Vec<f32> {
        let heads = q.len() / hd;
        if heads == 0 {
            return Vec::new();
        }
        (0..hd)
            .map(|c| {
                let pair = (c + hd / 2) % hd;
                let sum: f32 = q.chunks_exact(hd).map(|q| q[c] * q[c] + q[pair] * q[pair]).sum();
                (sum / heads as f32).sqrt()
            })
            .collect()
    }

    /// The reference and the per-channel scales of a stored header.
    pub(crate) fn decode(header: &[u8], hd: usize) -> (Vec<f32>, Vec<f32>) {
        let (mut reference, mut scales) = (vec![0.0; hd], vec![0.0; hd]);
        Self::decode_into(header, &mut reference, &mut scales);
        (reference, scales)
    }

    /// [`Self::decode`] into buffers of the head size (attention's per-page loop).
    pub(crate) fn decode_into(header: &[u8], reference: &mut [f32], scales: &mut [f32]) {
        let (codes, exps) = header.split_at(kv_rows::q4_0_row_bytes(reference.len()));
        kv_rows::decode_q4_0(codes, reference);
        Self::scales_into(exps, scales);
    }

    /// A stored key (a row `decode` reads) as the model's key: `ref + s * R^T row`.
    pub(crate) fn decode_key(
        (reference, scales): (&[f32], &[f32]),
        (rotation, decode): (&Rotation, DecodeFn),
        row: &[u8],
        out: &mut [f32],
    ) {
        decode(row, out);
        rotation.unrotate(out);
        for ((o, r), s) in out.iter_mut().zip(reference).zip(scales) {
            *o = r + s * *o;
        }
    }

    /// What the page stores of key `k` (before its 4-bit rounding): `R ((k - ref) / s)`.
    pub(crate) fn encode_key(
        (reference, scales): (&[f32], &[f32]),
        rotation: &Rotation,
        k: &mut [f32],
    ) {
        for ((v, r), s) in k.iter_mut().zip(reference).zip(scales) {
            *v = (*v - r) / s;
        }
        rotation.rotate(k);
    }

    fn scales(exps: &[u8], hd: usize) -> Vec<f32> {
        let mut scales = vec![0.0; hd];
        Self::scales_into(exps, &mut scales);
        scales
    }

    fn scales_into(exps: &[u8], scales: &mut [f32]) {
        if exps.is_empty() {
            return scales.fill(1.0);
        }
        for (c, s) in scales.iter_mut().enumerate() {
            let e = (exps[c / 2] >> (4 * (c % 2))) & 15;
            *s = 1.0 / (1u32 << e) as f32;
        }
    }
}

#[derive(Clone, Copy)]
pub(crate) enum PageReader {
    /// The head kernels read the stored rows as they are (float rows; int8 rows where the
    /// path has kernels for them).
    Stored(HeadKernels),
    /// Rows are widened to f32 (`decode`), then read by the f32 head kernels.
    Widened { decode: DecodeFn, f32: HeadKernels },
}

impl KvEncoding {
    pub const NAMES: [&str; 4] = ["f16", "f32", "int8", "int4"];

    pub fn parse(name: &str) -> Result<Self> {
        match name {
            "f16" => Ok(Self::F16),
            "f32" => Ok(Self::F32),
            "int8" => Ok(Self::Int8),
            "int4" => Ok(Self::Int4),
            other => Err(Error::InvalidArgument(format!(
                "unknown KV encoding '{other}' (expected one of {})",
                Self::NAMES.join(", ")
            ))),
        }
    }

    /// Bytes of one kv head's row of `head_dim` values.
    pub fn head_bytes(self, head_dim: usize) -> usize {
        match self {
            Self::F16 => 2 * head_dim,
            Self::F32 => 4 * head_dim,
            Self::Int8 => kv_rows::i8_row_bytes(head_dim),
            Self::Int4 => kv_rows::i4_row_bytes(head_dim),
        }
    }

    /// Whether pages keep a key header per kv head and store keys relative to it (see
    /// [`KeyHeader`]).
    /// Int8 keeps the reference alone (no scales: 0.524x of f16 with 64-dimension heads):
    /// perplexity at 2k against f16 -0.11% / +0.06% / +0.19% on SmolLM2 / Qwen2.5 / Gemma 3,
    /// against +0.24% / +0.03% / +0.01% without (an earlier engine had measured +0.05% /
    /// +0.29% / +0.28% with it).
    pub(crate) fn key_header(self) -> bool {
        matches!(self, Self::Int8 | Self::Int4)
    }

    /// Whether a key header holds per-channel scales besides its reference (int4; int8's
    /// are all 1, so its queries turn the same way on every page).
    pub(crate) fn key_scales(self) -> bool {
        self == Self::Int4
    }

    /// Bytes of one kv head's key header in a page (0 without one).
    pub fn header_bytes(self, head_dim: usize) -> usize {
        if self.key_header() {
            KeyHeader::bytes(head_dim, self.key_scales())
        } else {
            0
        }
    }

    /// The rotation of heads of `head_dim` before they are stored (queries and outputs
    /// turn with them), for the encodings that rotate.
    pub(crate) fn rotation(self, head_dim: usize) -> Option<Rotation> {
        matches!(self, Self::Int8 | Self::Int4).then(|| Rotation::new(head_dim))
    }

    /// Stores one head's values (already rotated where the encoding rotates).
    pub(crate) fn encode(self, src: &[f32], dst: &mut [u8]) {
        match self {
            Self::F32 => {
                for (d, s) in dst.chunks_exact_mut(4).zip(src) {
                    d.copy_from_slice(&s.to_le_bytes());
                }
            }
            Self::F16 => kv_rows::encode_f16(src, &mut dst[..2 * src.len()]),
            Self::Int8 => kv_rows::encode_i8(src, dst),
            Self::Int4 => kv_rows::encode_i4(src, dst),
        }
    }

    /// The decoder of one stored head row, on the selected ISA path.
    pub(crate) fn decoder(self) -> DecodeFn {
        match self {
            Self::F16 => PathKernels::selected().row_kernels(TensorFormat::F16).decode,
            Self::F32 => PathKernels::selected().row_kernels(TensorFormat::F32).decode,
            Self::Int8 => KvCodes::selected().i8,
            Self::Int4 => KvCodes::selected().i4,
        }
    }

    pub(crate) fn reader(self) -> PageReader {
        let path = PathKernels::selected();
        match self {
            Self::F16 => PageReader::Stored(path.head_kernels(TensorFormat::F16)),
            Self::F32 => PageReader::Stored(path.head_kernels(TensorFormat::F32)),
            Self::Int8 | Self::Int4 => match path.int8_head_kernels() {
                Some(k) if self == Self::Int8 => PageReader::Stored(k),
                _ => PageReader::Widened {
                    decode: self.decoder(),
                    f32: path.head_kernels(TensorFormat::F32),
                },
            },
        }
    }
}

/// What a cache of `encoding` gives back for value rows `x` (position-major, heads of
/// `head_dim`): each head rotated (where the encoding rotates), stored, decoded by the scalar
/// reference and turned back. Attention over a cache must equal dense attention over these
/// values.
#[cfg(test)]
pub(crate) fn stored_values(encoding: KvEncoding, head_dim: usize, x: &[f32]) -> Vec<f32> {
    stored_rows(encoding, head_dim, x)
}

/// As [`stored_values`] for key rows of `n_kv` heads in pages of `page_size` positions:
/// where the encoding keeps key headers, each page's keys are stored against the header its
/// first key, the previous page's stored keys and the first position's query heads of the
/// kv head give ([`KeyHeader`]; `q` holds every position's query row, or is empty), and
/// read back by decoding the 4-bit rows with the scalar reference, turning them back and
/// undoing the header.
#[cfg(test)]
pub(crate) fn stored_keys(
    encoding: KvEncoding,
    head_dim: usize,
    (n_kv, page_size): (usize, usize),
    q: &[f32],
    x: &[f32],
) -> Vec<f32> {
    use cellm_kernels::isa::Isa;
    if !encoding.key_header() {
        return stored_rows(encoding, head_dim, x);
    }
    let rotation = encoding.rotation(head_dim).expect("rotates");
    let (hd, width) = (head_dim, n_kv * head_dim);
    let mut out = vec![0.0f32; x.len()];
    let mut header = vec![0u8; encoding.header_bytes(hd)];
    let decode = match encoding {
        KvEncoding::Int8 => KvCodes::of(Isa::Scalar).i8,
        _ => KvCodes::of(Isa::Scalar).i4,
    };
    let mut row = vec![0u8; encoding.head_bytes(hd)];
    for h in 0..n_kv {
        let head = |v: &[f32], p: usize| v[p * width + h * hd..][..hd].to_vec();
        let positions = x.len() / width;
        let mut prev: Vec<f32> = Vec::new();
        for page in (0..positions).step_by(page_size) {
            let q_width = q.len() / positions;
            let group = q_width / width * hd;
            let queries = q.get(page * q_width + h * group..).map_or(&[][..], |q| &q[..group]);
            let importance = KeyHeader::importance(queries, hd);
            let (reference, scales) =
                KeyHeader::encode(&head(x, page), &prev, &importance, &mut header);
            prev.clear();
            for p in page..(page + page_size).min(positions) {
                let mut k = head(x, p);
                KeyHeader::encode_key((&reference, &scales), &rotation, &mut k);
                encoding.encode(&k, &mut row);
                decode(&row, &mut k);
                rotation.unrotate(&mut k);
                for ((o, r), s) in k.iter_mut().zip(&reference).zip(&scales) {
                    *o = r + s * *o;
                }
                out[p * width + h * hd..][..hd].copy_from_slice(&k);
                prev.extend_from_slice(&k);
            }
        }
    }
    out
}

#[cfg(test)]
fn stored_rows(encoding: KvEncoding, head_dim: usize, x: &[f32]) -> Vec<f32> {
    use cellm_kernels::isa::Isa;
    let rotation = encoding.rotation(head_dim);
    let mut x = x.to_vec();
    if let Some(r) = &rotation {
        r.rotate(&mut x);
    }
    let decode = match encoding {
        KvEncoding::F16 | KvEncoding::F32 => {
            let format =
                if encoding == KvEncoding::F16 { TensorFormat::F16 } else { TensorFormat::F32 };
            PathKernels::of(Isa::Scalar).row_kernels(format).decode
        }
        KvEncoding::Int8 => KvCodes::of(Isa::Scalar).i8,
        KvEncoding::Int4 => KvCodes::of(Isa::Scalar).i4,
    };
    // u32 storage: the float decoders read aligned rows.
    let mut words = vec![0u32; encoding.head_bytes(head_dim).div_ceil(4)];
    for head in x.chunks_exact_mut(head_dim) {
        // SAFETY: any byte pattern is a valid u32; the slice covers the same storage.
        let bytes = unsafe {
            std::slice::from_raw_parts_mut(words.as_mut_ptr().cast::<u8>(), words.len() * 4)
        };
        encoding.encode(head, &mut bytes[..encoding.head_bytes(head_dim)]);
        decode(&bytes[..encoding.head_bytes(head_dim)], head);
    }
    if let Some(r) = &rotation {
        r.unrotate(&mut x);
    }
    x
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Keys shaped like Qwen2.5's layer 0 (measured from the engine): a channel at -145 that
    /// barely moves (its k bias), a pair of amplitude 58 that RoPE turns by a radian a
    /// position, the rest of spread ~1. What attention sees of a key's error is how much
    /// `q . (stored - k)` varies across keys (a shift common to all keys leaves the softmax
    /// alone), for a query that reads the small channels. With the page header it must be
    /// several times smaller than with plain rotated 4-bit rows (measured: 0.18 of the
    /// scores' own spread against 1.37 over all pages; 0.087 against 1.35 past the first
    /// page, whose keys get per-channel scales), and under 0.2 past the first page.
    #[test]
    fn key_headers_tame_offset_and_turning_channels() {
        let (hd, n, ps) = (64, 256, 16);
        let mut seed = 12345u32;
        let mut rand = || {
            seed ^= seed << 13;
            seed ^= seed >> 17;
            seed ^= seed << 5;
            seed as f32 / u32::MAX as f32 * 2.0 - 1.0
        };
        let mut k = vec![0.0f32; n * hd];
        for (t, row) in k.chunks_exact_mut(hd).enumerate() {
            row.iter_mut().for_each(|v| *v = rand());
            row[62] = -145.0 + 0.3 * rand();
            (row[0], row[32]) = (58.0 * (t as f32).cos(), 58.0 * (t as f32).sin());
        }
        // A query that reads the small channels: their scores are what the outliers' share
        // of each group's levels would drown.
        let mut q: Vec<f32> = (0..hd).map(|_| rand()).collect();
        (q[0], q[32], q[62]) = (0.0, 0.0, 0.0);
        let spread_of = |x: &[f32]| {
            let s: Vec<f32> =
                x.chunks_exact(hd).map(|r| r.iter().zip(&q).map(|(a, b)| a * b).sum()).collect();
            let mean = s.iter().sum::<f32>() / s.len() as f32;
            (s.iter().map(|v| (v - mean).powi(2)).sum::<f32>() / s.len() as f32).sqrt()
        };
        let error_of = |stored: &[f32]| {
            let diff: Vec<f32> = stored.iter().zip(&k).map(|(a, b)| a - b).collect();
            spread_of(&diff) / spread_of(&k)
        };
        let plain = error_of(&stored_values(KvEncoding::Int4, hd, &k));
        let headed = error_of(&stored_keys(KvEncoding::Int4, hd, (1, ps), &[], &k));
        assert!(headed * 4.0 < plain, "with headers {headed}, plain rows {plain}");
        let later = |x: &[f32]| error_of_later(x, &k, ps * hd, &spread_of);
        let plain_later = later(&stored_values(KvEncoding::Int4, hd, &k));
        let headed_later = later(&stored_keys(KvEncoding::Int4, hd, (1, ps), &[], &k));
        assert!(headed_later * 4.0 < plain_later, "{headed_later} vs {plain_later}");
        assert!(headed_later < 0.2, "later pages: {headed_later} of the scores' spread");
        // With the query at every position telling the header which channels it reads
        // (none of the three large ones), the scales favour those channels, on the first
        // page too (measured: 0.080 of the scores' spread over all pages, against 0.18).
        let queries: Vec<f32> = (0..n).flat_map(|_| q.iter().copied()).collect();
        let aware = error_of(&stored_keys(KvEncoding::Int4, hd, (1, ps), &queries, &k));
        assert!(aware < 0.75 * headed, "query-aware scales {aware}, by the keys alone {headed}");
    }

    /// The error measure of the test above over positions past the first page.
    fn error_of_later(
        stored: &[f32],
        k: &[f32],
        skip: usize,
        spread_of: &dyn Fn(&[f32]) -> f32,
    ) -> f32 {
        let diff: Vec<f32> = stored[skip..].iter().zip(&k[skip..]).map(|(a, b)| a - b).collect();
        spread_of(&diff) / spread_of(&k[skip..])
    }
}
