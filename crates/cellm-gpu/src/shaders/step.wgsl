// The step buffer (written once per step, see step.rs): a header (tokens, logit rows,
// page-table words per layer, token capacity, row capacity, cos/sin pairs per RoPE table,
// positions per attention split, splits),
// then per token its id, position and page-table offset, then the rows whose logits are
// wanted, then every session's page table for every layer.
@group(0) @binding(7) var<storage, read> st: array<u32>;

fn n_tokens() -> u32 { return st[0]; }
fn n_logit_rows() -> u32 { return st[1]; }
fn token_id(t: u32) -> u32 { return st[8u + 4u * t]; }
fn token_pos(t: u32) -> u32 { return st[8u + 4u * t + 1u]; }
// Positions one attention split holds, and splits per (head, token).
fn split_len() -> u32 { return st[6]; }
fn n_splits() -> u32 { return st[7]; }
fn logit_row(r: u32) -> u32 { return st[8u + 4u * st[3] + r]; }
// Page `index` of the session of token `t` in `layer`.
fn page_of(t: u32, layer: u32, index: u32) -> u32 {
    return st[8u + 4u * st[3] + st[4] + layer * st[2] + st[8u + 4u * t + 2u] + index];
}
