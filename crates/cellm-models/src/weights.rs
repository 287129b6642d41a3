//! Where a model's tensors come from, and the one declaration of what it needs. Family loaders
//! ask [`Weights`] for each tensor by name, shape and [`Storage`]; loading from a file checks
//! the answer, and planning records the question. The converter plans (through
//! [`crate::expected_tensors`]) instead of keeping its own table of names and shapes.
//! (`blocks` adds the shorthands that build its blocks, `Weights::linear` and `norm`.)

use std::cell::RefCell;

use cellm_format::{CellmFile, Error, Result, Tensor, TensorFormat};

/// The formats a tensor may be stored in, by how the model reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Storage {
    /// Read element by element as f32: vectors (norms, biases), convolution kernels, and
    /// MoE routers (HF runs them in f32).
    F32,
    /// Multiplied by the kernels whole: any format, interleaved ones included.
    Matrix,
    /// Multiplied a slice of rows at a time (MLA's per-head blocks), which an interleaved
    /// format's 8-row groups would not allow.
    RowSlices,
}

impl Storage {
    pub fn allows(self, format: TensorFormat) -> bool {
        match self {
            Storage::F32 => format == TensorFormat::F32,
            Storage::Matrix => true,
            Storage::RowSlices => format.interleaved().is_none(),
        }
    }

    /// The allowed formats, f32 first.
    pub fn formats(self) -> Vec<TensorFormat> {
        TensorFormat::all().filter(|&f| self.allows(f)).collect()
    }
}

/// One tensor a model reads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorSpec {
    pub name: String,
    pub shape: Vec<usize>,
    pub storage: Storage,
}

/// Hands tensors to a loader: from a file (checked against what the loader asks), or, when
/// planning, as zeros while recording each request.
pub struct Weights<'a> {
    file: Option<&'a CellmFile>,
    asked: RefCell<Vec<TensorSpec>>,
}

impl<'a> Weights<'a> {
    pub fn from_file(file: &'a CellmFile) -> Self {
        Self { file: Some(file), asked: RefCell::default() }
    }

    /// No file: every tensor is zeros, and the requests are kept for [`Weights::into_specs`].
    pub fn planner() -> Self {
        Self { file: None, asked: RefCell::default() }
    }

    /// The tensors asked for, in the order the loader asked.
    pub fn into_specs(self) -> Vec<TensorSpec> {
        self.asked.into_inner()
    }

    /// Tensor `name` of `shape`, in a format `storage` allows.
    pub fn get(&self, name: &str, shape: &[usize], storage: Storage) -> Result<Tensor> {
        self.asked.borrow_mut().push(TensorSpec {
            name: name.to_string(),
            shape: shape.to_vec(),
            storage,
        });
        let Some(file) = self.file else {
            return Tensor::zeros(name, TensorFormat::F32, shape);
        };
        let t = file.tensor(name)?;
        if t.shape != shape {
            return Err(Error::format(format!(
                "tensor {name} has shape {:?}, expected {shape:?}",
                t.shape
            )));
        }
        if !storage.allows(t.format) {
            return Err(Error::format(format!(
                "tensor {name} is stored as {}, which this model cannot read there",
                t.format.name()
            )));
        }
        Ok(t)
    }

    /// A matrix in any format.
    pub fn tensor(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        self.get(name, shape, Storage::Matrix)
    }

    /// A 1-D f32 vector (norm weights, biases).
    pub fn vector(&self, name: &str, len: usize) -> Result<Tensor> {
        self.get(name, &[len], Storage::F32)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn planning_records_each_request_and_hands_out_zeros() {
        let w = Weights::planner();
        let linear = w.linear("proj", 8, 4, true).unwrap();
        assert_eq!(linear.weight.as_f32().unwrap(), &[0.0; 32]);
        w.get("conv.weight", &[4, 3], Storage::F32).unwrap();
        let asked: Vec<_> =
            w.into_specs().into_iter().map(|s| (s.name, s.shape, s.storage)).collect();
        assert_eq!(
            asked,
            [
                ("proj.weight".to_string(), vec![8, 4], Storage::Matrix),
                ("proj.bias".to_string(), vec![8], Storage::F32),
                ("conv.weight".to_string(), vec![4, 3], Storage::F32),
            ]
        );
    }

    #[test]
    fn storage_kinds_allow_their_formats() {
        assert_eq!(Storage::F32.formats(), [TensorFormat::F32]);
        let rows = Storage::RowSlices.formats();
        assert!(rows.contains(&TensorFormat::Q4_0) && !rows.contains(&TensorFormat::Q4_0X8));
        assert_eq!(Storage::Matrix.formats().len(), TensorFormat::all().count());
        assert_eq!(Storage::Matrix.formats()[0], TensorFormat::F32);
    }
}
