// The KV pool: pages of `page_size` positions, keys then values, each row `kv_dim` values
// stored as f32 or as f16 two to a word.
struct Kv {
    page_size: u32,
    kv_dim: u32,
    f16: u32,
    _pad: u32,
}

// Index (in values) of element `d` of the key (plane 0) or value (plane 1) row of `slot`.
fn kv_index(kv: Kv, page: u32, plane: u32, slot: u32, d: u32) -> u32 {
    return ((page * 2u + plane) * kv.page_size + slot) * kv.kv_dim + d;
}
