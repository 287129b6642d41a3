//! Per-session recurrent state: the rolling inputs of short convolutions and the matrices of
//! linear-attention recurrences. Unlike KV pages it cannot be rewound, only reset.

/// One zero-initialised f32 buffer per entry of a model's state layout.
#[derive(Debug, Default, Clone)]
pub struct SeqState {
    buffers: Vec<Vec<f32>>,
}

impl SeqState {
    /// `layout[i]` floats for buffer `i` (a model numbers its own buffers).
    pub fn new(layout: &[usize]) -> Self {
        Self { buffers: layout.iter().map(|&n| vec![0.0; n]).collect() }
    }

    pub fn is_empty(&self) -> bool {
        self.buffers.is_empty()
    }

    pub fn reset(&mut self) {
        self.buffers.iter_mut().for_each(|b| b.fill(0.0));
    }

    pub fn buffer(&mut self, i: usize) -> &mut [f32] {
        &mut self.buffers[i]
    }
}
