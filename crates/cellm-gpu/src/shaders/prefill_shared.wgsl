// Helpers both prefill attention kernels share (attn_prefill.rs puts them before either).

// The first position a token at `pos` attends to.
fn window_start(pos: u32) -> u32 {
    if (p.window != 0u && pos + 1u > p.window) {
        return pos + 1u - p.window;
    }
    return 0u;
}

fn table_of(t: u32) -> u32 {
    return st[8u + 4u * t + 2u];
}
