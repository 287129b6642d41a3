// Weight accessors, one per GPU weight layout (see repack.rs). Each defines the bindings
// `wq$` (and `ws$`) at @binding($Q) / @binding($S), `fn w4$(r, i) -> vec4<f32>`: columns
// 4i..4i+3 of row r, dequantized, and `fn w8$(r, i) -> array<vec4<f32>, 2>`: columns
// 8i..8i+7 (rows of a multiple of 8 columns), sharing the block's scales and loads. `$` is a
// suffix so a kernel can hold two matrices. Only the section of the format in use is kept
// (between `//# name` and `//# end`). A format may also define `fn d8$(r, i, x0, x1, xs) ->
// f32`: the dot product of those 8 columns with x (x0: columns 0-3, x1: 4-7; xs: their sum,
// for the blocks' offsets), computed on the quants with the scales applied once (the
// one-token matvec uses it); kernels.rs adds the plain one (w8 and two dots) where not. q4_k
// and q6_k also define `fn d16$(r, u, xa0, xa1, xb0, xb1, sum_a, sum_b) -> f32`: unit u of a
// row, 16 columns from one pair of words (the 8 at c and the 8 at c + H16, `d16_half` in
// kernels.rs; matvec.wgsl's D16 loop says which c), and `fn d16i$(r, u, xa, xb, dx, sum_a,
// sum_b) -> f32`: the same with x as int8 (`i8x` in matvec.wgsl), by `dot4I8Packed`.

//# f32
@group(0) @binding($Q) var<storage, read> wq$: array<vec4<f32>>;
fn w4$(r: u32, i: u32) -> vec4<f32> {
    return wq$[r * (p.cols / 4u) + i];
}
fn w8$(r: u32, i: u32) -> array<vec4<f32>, 2> {
    return array<vec4<f32>, 2>(w4$(r, 2u * i), w4$(r, 2u * i + 1u));
}
//# end

//# f16
@group(0) @binding($Q) var<storage, read> wq$: array<vec2<u32>>;
fn w4$(r: u32, i: u32) -> vec4<f32> {
    let v = wq$[r * (p.cols / 4u) + i];
    return vec4<f32>(unpack2x16float(v.x), unpack2x16float(v.y));
}
fn w8$(r: u32, i: u32) -> array<vec4<f32>, 2> {
    let at = r * (p.cols / 4u) + 2u * i;
    let a = wq$[at];
    let b = wq$[at + 1u];
    return array<vec4<f32>, 2>(vec4<f32>(unpack2x16float(a.x), unpack2x16float(a.y)),
                               vec4<f32>(unpack2x16float(b.x), unpack2x16float(b.y)));
}
//# end

//# f16v4
// f16 as above, 8 to a 16-byte element: one load per `w8` (the upload pads buffers to 16
// bytes, so a row's last 4 columns are in bounds where cols % 8 == 4).
@group(0) @binding($Q) var<storage, read> wq$: array<vec4<u32>>;
fn w4$(r: u32, i: u32) -> vec4<f32> {
    let at = r * (p.cols / 4u) + i;
    let v = wq$[at / 2u];
    let h = select(v.xy, v.zw, (at & 1u) == 1u);
    return vec4<f32>(unpack2x16float(h.x), unpack2x16float(h.y));
}
fn w8$(r: u32, i: u32) -> array<vec4<f32>, 2> {
    let v = wq$[r * (p.cols / 8u) + i];
    return array<vec4<f32>, 2>(vec4<f32>(unpack2x16float(v.x), unpack2x16float(v.y)),
                               vec4<f32>(unpack2x16float(v.z), unpack2x16float(v.w)));
}
//# end

//# bf16
@group(0) @binding($Q) var<storage, read> wq$: array<vec2<u32>>;
fn w4$(r: u32, i: u32) -> vec4<f32> {
    let v = wq$[r * (p.cols / 4u) + i];
    return vec4<f32>(
        bitcast<f32>(v.x << 16u), bitcast<f32>(v.x & 0xffff0000u),
        bitcast<f32>(v.y << 16u), bitcast<f32>(v.y & 0xffff0000u));
}
fn w8$(r: u32, i: u32) -> array<vec4<f32>, 2> {
    return array<vec4<f32>, 2>(w4$(r, 2u * i), w4$(r, 2u * i + 1u));
}
//# end

//# q8_0
// Blocks of 32: int8 quants (8 words a block), f16 scales two to a word.
@group(0) @binding($Q) var<storage, read> wq$: array<u32>;
@group(0) @binding($S) var<storage, read> ws$: array<u32>;
fn w4$(r: u32, i: u32) -> vec4<f32> {
    let b = r * (p.cols / 32u) + i / 8u;
    let d = unpack2x16float(ws$[b / 2u])[b % 2u];
    // Each byte shifted to the top, then arithmetically back: its signed value.
    let w = vec4<i32>(i32(wq$[b * 8u + i % 8u]));
    return d * vec4<f32>((w << vec4<u32>(24u, 16u, 8u, 0u)) >> vec4<u32>(24u));
}
fn w8$(r: u32, i: u32) -> array<vec4<f32>, 2> {
    return array<vec4<f32>, 2>(w4$(r, 2u * i), w4$(r, 2u * i + 1u));
}
//# end

//# q4_0
// Blocks of 32: ggml's 16 bytes of nibbles (4 words; byte j holds elements j and j + 16),
// f16 scales two to a word; w = d * (q - 8).
@group(0) @binding($Q) var<storage, read> wq$: array<u32>;
@group(0) @binding($S) var<storage, read> ws$: array<u32>;
fn w4$(r: u32, i: u32) -> vec4<f32> {
    let b = r * (p.cols / 32u) + i / 8u;
    let d = unpack2x16float(ws$[b / 2u])[b % 2u];
    let j = i % 8u;
    let w = wq$[b * 4u + j % 4u] >> select(0u, 4u, j >= 4u);
    let q = vec4<f32>(f32(w & 15u), f32((w >> 8u) & 15u), f32((w >> 16u) & 15u),
                      f32((w >> 24u) & 15u));
    return d * (q - 8.0);
}
fn w8$(r: u32, i: u32) -> array<vec4<f32>, 2> {
    return array<vec4<f32>, 2>(w4$(r, 2u * i), w4$(r, 2u * i + 1u));
}
//# end

//# q4_1
// Blocks of 32: q4_0's nibbles, and one word a block of f16 d and m; w = d * q + m.
@group(0) @binding($Q) var<storage, read> wq$: array<u32>;
@group(0) @binding($S) var<storage, read> ws$: array<u32>;
fn w4$(r: u32, i: u32) -> vec4<f32> {
    let b = r * (p.cols / 32u) + i / 8u;
    let dm = unpack2x16float(ws$[b]);
    let j = i % 8u;
    let w = wq$[b * 4u + j % 4u] >> select(0u, 4u, j >= 4u);
    let q = vec4<f32>(f32(w & 15u), f32((w >> 8u) & 15u), f32((w >> 16u) & 15u),
                      f32((w >> 24u) & 15u));
    return dm.x * q + vec4<f32>(dm.y);
}
fn w8$(r: u32, i: u32) -> array<vec4<f32>, 2> {
    return array<vec4<f32>, 2>(w4$(r, 2u * i), w4$(r, 2u * i + 1u));
}
fn d8$(r: u32, i: u32, x0: vec4<f32>, x1: vec4<f32>, xs: f32) -> f32 {
    // w4 indices 2i and 2i + 1: words j, j + 1 of the block at the same shift.
    let b = r * (p.cols / 32u) + i / 4u;
    let j = (2u * i) % 8u;
    let at = b * 4u + j % 4u;
    let sh = select(0u, 4u, j >= 4u);
    let q0 = vec4<f32>(unpack4xU8((wq$[at] >> sh) & 0x0f0f0f0fu));
    let q1 = vec4<f32>(unpack4xU8((wq$[at + 1u] >> sh) & 0x0f0f0f0fu));
    let dm = unpack2x16float(ws$[b]);
    return dm.x * (dot(q0, x0) + dot(q1, x1)) + dm.y * xs;
}
//# end

//# q5_0
// Blocks of 32 as 5 words: q4_0's nibbles, then the fifth bits (bit e: element e); f16
// scales two to a word; w = d * (q - 16).
@group(0) @binding($Q) var<storage, read> wq$: array<u32>;
@group(0) @binding($S) var<storage, read> ws$: array<u32>;
fn w4$(r: u32, i: u32) -> vec4<f32> {
    let b = r * (p.cols / 32u) + i / 8u;
    let d = unpack2x16float(ws$[b / 2u])[b % 2u];
    let j = i % 8u;
    let w = wq$[b * 5u + j % 4u] >> select(0u, 4u, j >= 4u);
    let h = wq$[b * 5u + 4u] >> (4u * j);
    let q = vec4<f32>(f32((w & 15u) | ((h & 1u) << 4u)),
                      f32(((w >> 8u) & 15u) | (((h >> 1u) & 1u) << 4u)),
                      f32(((w >> 16u) & 15u) | (((h >> 2u) & 1u) << 4u)),
                      f32(((w >> 24u) & 15u) | (((h >> 3u) & 1u) << 4u)));
    return d * (q - 16.0);
}
fn w8$(r: u32, i: u32) -> array<vec4<f32>, 2> {
    return array<vec4<f32>, 2>(w4$(r, 2u * i), w4$(r, 2u * i + 1u));
}
//# end

//# q4_k
// Super-blocks of 256: ggml's 128 bytes of nibbles (32 words; in each 64 elements, byte l
// holds elements l and l + 32), and 5 words: f16 d and dmin, then the 8 sub-block scales
// and the 8 mins unpacked to bytes; w = d * sc * q - dmin * m.
@group(0) @binding($Q) var<storage, read> wq$: array<u32>;
@group(0) @binding($S) var<storage, read> ws$: array<u32>;
fn w4$(r: u32, i: u32) -> vec4<f32> {
    let sb = r * (p.cols / 256u) + i / 64u;
    let e = (i % 64u) * 4u;
    let l = e % 64u;
    let w = wq$[sb * 32u + (e / 64u) * 8u + (l % 32u) / 4u] >> select(0u, 4u, l >= 32u);
    let q = vec4<f32>(f32(w & 15u), f32((w >> 8u) & 15u), f32((w >> 16u) & 15u),
                      f32((w >> 24u) & 15u));
    let dm = unpack2x16float(ws$[sb * 5u]);
    let sub = e / 32u;
    let sc = f32((ws$[sb * 5u + 1u + sub / 4u] >> (8u * (sub % 4u))) & 255u);
    let m = f32((ws$[sb * 5u + 3u + sub / 4u] >> (8u * (sub % 4u))) & 255u);
    return (dm.x * sc) * q - vec4<f32>(dm.y * m);
}
fn w8$(r: u32, i: u32) -> array<vec4<f32>, 2> {
    let sb = r * (p.cols / 256u) + i / 32u;
    let e = (i % 32u) * 8u;
    let l = e % 64u;
    let at = sb * 32u + (e / 64u) * 8u + (l % 32u) / 4u;
    let sh = select(0u, 4u, l >= 32u);
    let w0 = wq$[at] >> sh;
    let w1 = wq$[at + 1u] >> sh;
    let dm = unpack2x16float(ws$[sb * 5u]);
    let sub = e / 32u;
    let sc = f32((ws$[sb * 5u + 1u + sub / 4u] >> (8u * (sub % 4u))) & 255u);
    let m = f32((ws$[sb * 5u + 3u + sub / 4u] >> (8u * (sub % 4u))) & 255u);
    let q0 = vec4<f32>(vec4<u32>(w0, w0 >> 8u, w0 >> 16u, w0 >> 24u) & vec4<u32>(15u));
    let q1 = vec4<f32>(vec4<u32>(w1, w1 >> 8u, w1 >> 16u, w1 >> 24u) & vec4<u32>(15u));
    let d = dm.x * sc;
    let mm = vec4<f32>(dm.y * m);
    return array<vec4<f32>, 2>(d * q0 - mm, d * q1 - mm);
}
fn d8$(r: u32, i: u32, x0: vec4<f32>, x1: vec4<f32>, xs: f32) -> f32 {
    let sb = r * (p.cols / 256u) + i / 32u;
    let e = (i % 32u) * 8u;
    let at = sb * 32u + (e / 64u) * 8u + (e % 32u) / 4u;
    let sh = select(0u, 4u, e % 64u >= 32u);
    let q0 = vec4<f32>(unpack4xU8((wq$[at] >> sh) & 0x0f0f0f0fu));
    let q1 = vec4<f32>(unpack4xU8((wq$[at + 1u] >> sh) & 0x0f0f0f0fu));
    let dm = unpack2x16float(ws$[sb * 5u]);
    let sub = e / 32u;
    let sc = f32((ws$[sb * 5u + 1u + sub / 4u] >> (8u * (sub % 4u))) & 255u);
    let m = f32((ws$[sb * 5u + 3u + sub / 4u] >> (8u * (sub % 4u))) & 255u);
    return (dm.x * sc) * (dot(q0, x0) + dot(q1, x1)) - (dm.y * m) * xs;
}
// Unit u of a row (matvec.wgsl's D16 loop; H16 = 32): words 2(u % 16), +1 of super-block
// u / 16, whose low nibbles are 8 columns of sub-block 2g (g = (u % 16) / 4) and high
// nibbles the same 8 of sub-block 2g + 1 (scales and mins: bytes 2g, 2g + 1 of one word).
fn d16$(r: u32, u: u32, xa0: vec4<f32>, xa1: vec4<f32>, xb0: vec4<f32>, xb1: vec4<f32>,
        sum_a: f32, sum_b: f32) -> f32 {
    let sb = r * (p.cols / 256u) + u / 16u;
    let at = sb * 32u + (u % 16u) * 2u;
    let w0 = wq$[at];
    let w1 = wq$[at + 1u];
    let lo = dot(vec4<f32>(unpack4xU8(w0 & 0x0f0f0f0fu)), xa0)
        + dot(vec4<f32>(unpack4xU8(w1 & 0x0f0f0f0fu)), xa1);
    let hi = dot(vec4<f32>(unpack4xU8((w0 >> 4u) & 0x0f0f0f0fu)), xb0)
        + dot(vec4<f32>(unpack4xU8((w1 >> 4u) & 0x0f0f0f0fu)), xb1);
    let dm = unpack2x16float(ws$[sb * 5u]);
    let sub = ((u % 16u) / 4u) * 2u;
    let sh = 8u * (sub % 4u);
    let scw = ws$[sb * 5u + 1u + sub / 4u] >> sh;
    let mw = ws$[sb * 5u + 3u + sub / 4u] >> sh;
    let sc = vec2<f32>(f32(scw & 255u), f32((scw >> 8u) & 255u));
    let m = vec2<f32>(f32(mw & 255u), f32((mw >> 8u) & 255u));
    return dm.x * (sc.x * lo + sc.y * hi) - dm.y * (m.x * sum_a + m.y * sum_b);
}
// `d16` with x as int8 (matvec.wgsl's `i8x`: xa, xb the 8 columns at c and c + 32, dx their
// scale): the nibbles times x by packed integer dots, both sub-blocks' scales applied in
// integers, one conversion; the mins' term from x's float sums.
fn d16i$(r: u32, u: u32, xa: vec2<u32>, xb: vec2<u32>, dx: f32, sum_a: f32, sum_b: f32) -> f32 {
    let sb = r * (p.cols / 256u) + u / 16u;
    let at = sb * 32u + (u % 16u) * 2u;
    let w0 = wq$[at];
    let w1 = wq$[at + 1u];
    let lo = dot4I8Packed(w0 & 0x0f0f0f0fu, xa.x) + dot4I8Packed(w1 & 0x0f0f0f0fu, xa.y);
    let hi = dot4I8Packed((w0 >> 4u) & 0x0f0f0f0fu, xb.x)
        + dot4I8Packed((w1 >> 4u) & 0x0f0f0f0fu, xb.y);
    let dm = unpack2x16float(ws$[sb * 5u]);
    let sub = ((u % 16u) / 4u) * 2u;
    let sh = 8u * (sub % 4u);
    let scw = ws$[sb * 5u + 1u + sub / 4u] >> sh;
    let mw = ws$[sb * 5u + 3u + sub / 4u] >> sh;
    let q = i32(scw & 255u) * lo + i32((scw >> 8u) & 255u) * hi;
    let m = vec2<f32>(f32(mw & 255u), f32((mw >> 8u) & 255u));
    return (dm.x * dx) * f32(q) - dm.y * (m.x * sum_a + m.y * sum_b);
}
//# end

//# q6_k
// Super-blocks of 256 as 48 words: the low 4 bits of each 6-bit quant, 8 to a word in
// element order, then the high 2 bits, 16 to a word; and 5 words: d (f32), then the 16
// int8 scales of 16 elements each; w = d * sc * (q - 32).
@group(0) @binding($Q) var<storage, read> wq$: array<u32>;
@group(0) @binding($S) var<storage, read> ws$: array<u32>;
fn w4$(r: u32, i: u32) -> vec4<f32> {
    let sb = r * (p.cols / 256u) + i / 64u;
    let e = (i % 64u) * 4u;
    let lo = wq$[sb * 48u + e / 8u] >> ((e % 8u) * 4u);
    let hi = wq$[sb * 48u + 32u + e / 16u] >> ((e % 16u) * 2u);
    let q = vec4<f32>(
        f32((lo & 15u) | ((hi & 3u) << 4u)),
        f32(((lo >> 4u) & 15u) | (((hi >> 2u) & 3u) << 4u)),
        f32(((lo >> 8u) & 15u) | (((hi >> 4u) & 3u) << 4u)),
        f32(((lo >> 12u) & 15u) | (((hi >> 6u) & 3u) << 4u)));
    let s = e / 16u;
    let sc = f32((i32(ws$[sb * 5u + 1u + s / 4u]) << (24u - 8u * (s % 4u))) >> 24u);
    return (bitcast<f32>(ws$[sb * 5u]) * sc) * (q - 32.0);
}
fn w8$(r: u32, i: u32) -> array<vec4<f32>, 2> {
    let sb = r * (p.cols / 256u) + i / 32u;
    let e = (i % 32u) * 8u;
    let lo = wq$[sb * 48u + e / 8u];
    let hi = wq$[sb * 48u + 32u + e / 16u] >> ((e % 16u) * 2u);
    let l0 = vec4<u32>(lo, lo >> 4u, lo >> 8u, lo >> 12u) & vec4<u32>(15u);
    let l1 = vec4<u32>(lo >> 16u, lo >> 20u, lo >> 24u, lo >> 28u) & vec4<u32>(15u);
    let h0 = (vec4<u32>(hi, hi >> 2u, hi >> 4u, hi >> 6u) & vec4<u32>(3u)) << vec4<u32>(4u);
    let h1 = (vec4<u32>(hi >> 8u, hi >> 10u, hi >> 12u, hi >> 14u) & vec4<u32>(3u))
        << vec4<u32>(4u);
    let s = e / 16u;
    let sc = f32((i32(ws$[sb * 5u + 1u + s / 4u]) << (24u - 8u * (s % 4u))) >> 24u);
    let d = bitcast<f32>(ws$[sb * 5u]) * sc;
    return array<vec4<f32>, 2>(d * (vec4<f32>(l0 | h0) - 32.0), d * (vec4<f32>(l1 | h1) - 32.0));
}
// The 2-bit fields at bits 4k (k = 0..3) of `h` moved to bits 8k + 4 (the high bits of
// byte k's 6-bit quant).
fn q6_spread$(h: u32) -> u32 {
    let a = (h & 0x00ffu) | ((h & 0xff00u) << 8u);
    return ((a & 0x000f000fu) | ((a & 0x00f000f0u) << 4u)) << 4u;
}
fn d8$(r: u32, i: u32, x0: vec4<f32>, x1: vec4<f32>, xs: f32) -> f32 {
    let sb = r * (p.cols / 256u) + i / 32u;
    let e = (i % 32u) * 8u;
    let lo = wq$[sb * 48u + e / 8u];
    let hi = wq$[sb * 48u + 32u + e / 16u] >> ((e % 16u) * 2u);
    // Bytes of the even elements (0, 2, 4, 6) and of the odd ones, as 6-bit quants.
    let qe = vec4<f32>(unpack4xU8((lo & 0x0f0f0f0fu) | q6_spread$(hi & 0x3333u)));
    let qo = vec4<f32>(unpack4xU8(((lo >> 4u) & 0x0f0f0f0fu) | q6_spread$((hi >> 2u) & 0x3333u)));
    let s = e / 16u;
    let sc = f32((i32(ws$[sb * 5u + 1u + s / 4u]) << (24u - 8u * (s % 4u))) >> 24u);
    let d = bitcast<f32>(ws$[sb * 5u]) * sc;
    let xe = vec4<f32>(x0.x, x0.z, x1.x, x1.z);
    let xo = vec4<f32>(x0.y, x0.w, x1.y, x1.w);
    return d * (dot(qe, xe) + dot(qo, xo) - 32.0 * xs);
}
// The dot product of 8 columns with x (x0, x1) from their low 4 bits `lo` (element order)
// and high 2 bits `hi` (bits 2k: element k), without the block's scale and offset.
fn q6_dot8$(lo: u32, hi: u32, x0: vec4<f32>, x1: vec4<f32>) -> f32 {
    let qe = vec4<f32>(unpack4xU8((lo & 0x0f0f0f0fu) | q6_spread$(hi & 0x3333u)));
    let qo = vec4<f32>(unpack4xU8(((lo >> 4u) & 0x0f0f0f0fu) | q6_spread$((hi >> 2u) & 0x3333u)));
    return dot(qe, vec4<f32>(x0.x, x0.z, x1.x, x1.z)) + dot(qo, vec4<f32>(x0.y, x0.w, x1.y, x1.w));
}
// Unit u of a row (matvec.wgsl's D16 loop; H16 = 8): the 16 columns of scale u % 16 of
// super-block u / 16, from two words of low bits and one of high bits, and that scale times
// the super-block's d.
struct Q6Unit$ {
    lo0: u32,
    lo1: u32,
    hi: u32,
    d: f32,
}
fn q6_unit$(r: u32, u: u32) -> Q6Unit$ {
    let sb = r * (p.cols / 256u) + u / 16u;
    let at = sb * 48u + (u % 16u) * 2u;
    let s = u % 16u;
    let sc = f32((i32(ws$[sb * 5u + 1u + s / 4u]) << (24u - 8u * (s % 4u))) >> 24u);
    return Q6Unit$(wq$[at], wq$[at + 1u], wq$[sb * 48u + 32u + s], bitcast<f32>(ws$[sb * 5u]) * sc);
}
fn d16$(r: u32, u: u32, xa0: vec4<f32>, xa1: vec4<f32>, xb0: vec4<f32>, xb1: vec4<f32>,
        sum_a: f32, sum_b: f32) -> f32 {
    let w = q6_unit$(r, u);
    let q = q6_dot8$(w.lo0, w.hi, xa0, xa1) + q6_dot8$(w.lo1, w.hi >> 16u, xb0, xb1);
    return w.d * (q - 32.0 * (sum_a + sum_b));
}
// `d16` with x as int8 (matvec.wgsl's `i8x` with I8EO: each word pair the even columns of 8,
// then the odd ones; dx their scale): the 6-bit quants' bytes (even and odd, as `q6_dot8`)
// times x by packed integer dots, one conversion; the offset of 32 from x's float sums.
fn d16i$(r: u32, u: u32, xa: vec2<u32>, xb: vec2<u32>, dx: f32, sum_a: f32, sum_b: f32) -> f32 {
    let w = q6_unit$(r, u);
    let ae = (w.lo0 & 0x0f0f0f0fu) | q6_spread$(w.hi & 0x3333u);
    let ao = ((w.lo0 >> 4u) & 0x0f0f0f0fu) | q6_spread$((w.hi >> 2u) & 0x3333u);
    let be = (w.lo1 & 0x0f0f0f0fu) | q6_spread$((w.hi >> 16u) & 0x3333u);
    let bo = ((w.lo1 >> 4u) & 0x0f0f0f0fu) | q6_spread$((w.hi >> 18u) & 0x3333u);
    let q = dot4I8Packed(ae, xa.x) + dot4I8Packed(ao, xa.y) + dot4I8Packed(be, xb.x)
        + dot4I8Packed(bo, xb.y);
    return w.d * (dx * f32(q) - 32.0 * (sum_a + sum_b));
}
//# end
