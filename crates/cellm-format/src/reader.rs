//! Opening a `.cellm` file: map it, check the preamble, parse and validate the header.

use std::collections::HashMap;
use std::fs::File;
use std::path::Path;
use std::sync::Arc;

use memmap2::Mmap;
use serde::Deserialize;

use crate::tensor::{Tensor, TensorFormat};
use crate::{Error, Result};

pub const MAGIC: &[u8; 5] = b"CELLM";
pub const FORMAT_VERSION: u8 = 2;
const PREAMBLE: usize = 16;
const ALIGN: usize = 64;

#[derive(Debug, Clone, Deserialize)]
pub struct TensorEntry {
    pub name: String,
    pub format: String,
    pub shape: Vec<usize>,
    pub offset: usize,
    pub nbytes: usize,
    #[serde(default)]
    pub params: serde_json::Map<String, serde_json::Value>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct BlobEntry {
    pub name: String,
    pub offset: usize,
    pub nbytes: usize,
}

/// The parts of the header the engine reads; the rest stays available as raw JSON.
#[derive(Debug, Clone, Deserialize)]
pub struct Header {
    pub format_version: u32,
    pub model: serde_json::Value,
    pub tensors: Vec<TensorEntry>,
    #[serde(default)]
    pub blobs: Vec<BlobEntry>,
    pub data_size: usize,
}

/// A validated, memory-mapped `.cellm` file.
pub struct CellmFile {
    map: Arc<Mmap>,
    header: Header,
    header_json: String,
    data_offset: usize,
    tensors: HashMap<String, usize>,
}

impl CellmFile {
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let shown = path.display();
        let file = File::open(path).map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => Error::format(format!("{shown}: no such file")),
            _ => Error::format(format!("{shown}: cannot open: {e}")),
        })?;
        if file.metadata().map(|m| m.is_dir()).unwrap_or(false) {
            return Err(Error::format(format!("{shown} is a directory, not a .cellm file")));
        }
        // SAFETY: the map is read-only, and the bytes are validated once, here. A file
        // rewritten in place while mapped is not defended against (docs/format.md, "A file
        // changed while in use"): truncating it makes the next read of a page past its new
        // end SIGBUS, even with a private (copy-on-write) map, and other writes change weights
        // under a running model. A read lease (F_SETLEASE) would only delay a writer by the
        // lease-break time, for the file's owner, at the price of a SIGIO. The converter
        // writes a new file and renames it over the old one, which leaves this mapping intact.
        let map = unsafe { Mmap::map(&file) }
            .map_err(|e| Error::format(format!("{shown}: cannot map: {e}")))?;
        let len = map.len();
        Self::from_map(Arc::new(map), len).map_err(|e| match e {
            Error::Format(m) => Error::Format(format!("{shown}: {m}")),
            other => other,
        })
    }

    /// A file held in memory: `bytes` are copied into an anonymous map, which nothing else
    /// can change (tests, fuzzing, files read whole).
    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        // An empty map is refused by the OS; a spare byte keeps the path uniform.
        let mut map = memmap2::MmapOptions::new()
            .len(bytes.len().max(1))
            .map_anon()
            .map_err(|e| Error::format(format!("cannot map {} bytes: {e}", bytes.len())))?;
        map[..bytes.len()].copy_from_slice(bytes);
        let map = map
            .make_read_only()
            .map_err(|e| Error::format(format!("cannot map {} bytes: {e}", bytes.len())))?;
        Self::from_map(Arc::new(map), bytes.len())
    }

    fn from_map(map: Arc<Mmap>, len: usize) -> Result<Self> {
        let (header_json, data_offset) = read_preamble(&map[..len])?;
        let header: Header = serde_json::from_str(&header_json)
            .map_err(|e| Error::format(format!("corrupted header: {e}")))?;
        if header.format_version != u32::from(FORMAT_VERSION) {
            return Err(Error::format(format!(
                "header says format_version {} but the preamble says {FORMAT_VERSION}",
                header.format_version
            )));
        }
        let expected = data_offset.checked_add(header.data_size);
        if expected != Some(len) {
            return Err(Error::format(format!(
                "file is {len} bytes but the header describes {} (truncated or corrupted)",
                expected.map_or("an impossible size".to_string(), |n| n.to_string())
            )));
        }
        let tensors = validate_table(&header)?;
        Ok(Self { map, header, header_json, data_offset, tensors })
    }

    pub fn header(&self) -> &Header {
        &self.header
    }

    /// The header as stored, for Python (tokenizer config, chat template, generation config).
    pub fn header_json(&self) -> &str {
        &self.header_json
    }

    pub fn has_tensor(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    pub fn tensor(&self, name: &str) -> Result<Tensor> {
        let &i = self
            .tensors
            .get(name)
            .ok_or_else(|| Error::format(format!("missing tensor {name}")))?;
        let e = &self.header.tensors[i];
        let format = TensorFormat::parse(&e.format)?;
        Ok(Tensor::new(
            self.map.clone(),
            self.data_offset + e.offset,
            e.nbytes,
            e.name.clone(),
            format,
            e.shape.clone(),
        ))
    }

    pub fn blob(&self, name: &str) -> Option<&[u8]> {
        let b = self.header.blobs.iter().find(|b| b.name == name)?;
        let start = self.data_offset + b.offset;
        Some(&self.map[start..start + b.nbytes])
    }
}

/// Checks magic, version and header length; returns the header text and the data offset.
fn read_preamble(map: &[u8]) -> Result<(String, usize)> {
    if map.len() < PREAMBLE || &map[..5] != MAGIC {
        return Err(Error::format("not a .cellm file (bad magic)"));
    }
    match map[5] {
        FORMAT_VERSION => {}
        1 => {
            return Err(Error::format(
                "this is a version 1 .cellm file (the earlier engine); re-convert it with \
                 `python -m cellm.convert`",
            ))
        }
        v => {
            return Err(Error::format(format!(
                "format version {v} is newer than this cellm understands ({FORMAT_VERSION})"
            )))
        }
    }
    let header_len = u64::from_le_bytes(map[8..16].try_into().expect("8 bytes"));
    let header_end = usize::try_from(header_len)
        .ok()
        .and_then(|n| n.checked_add(PREAMBLE))
        .filter(|&end| end <= map.len())
        .ok_or_else(|| Error::format("header length runs past the end of the file (truncated)"))?;
    let text = std::str::from_utf8(&map[PREAMBLE..header_end])
        .map_err(|_| Error::format("corrupted header: not UTF-8"))?;
    Ok((text.to_owned(), header_end.div_ceil(ALIGN) * ALIGN))
}

/// Every tensor and blob must sit aligned inside the data section, not overlap another, and
/// have exactly the size its format and shape imply.
fn validate_table(h: &Header) -> Result<HashMap<String, usize>> {
    let mut ranges: Vec<(usize, usize, &str)> = Vec::new();
    let mut index = HashMap::new();
    for (i, t) in h.tensors.iter().enumerate() {
        let format = TensorFormat::parse(&t.format)?;
        if format.nbytes(&t.shape) != Some(t.nbytes) {
            return Err(Error::format(format!(
                "tensor {}: {} bytes do not match shape {:?} in {}",
                t.name, t.nbytes, t.shape, t.format
            )));
        }
        if t.offset % ALIGN != 0 || t.offset % format.alignment() != 0 {
            return Err(Error::format(format!(
                "tensor {}: offset {} is not aligned",
                t.name, t.offset
            )));
        }
        if index.insert(t.name.clone(), i).is_some() {
            return Err(Error::format(format!("tensor {} appears twice", t.name)));
        }
        ranges.push((t.offset, t.nbytes, &t.name));
    }
    for b in &h.blobs {
        ranges.push((b.offset, b.nbytes, &b.name));
    }
    ranges.sort_unstable();
    let mut end_of_previous = 0usize;
    for &(offset, nbytes, name) in &ranges {
        let end = offset
            .checked_add(nbytes)
            .filter(|&end| end <= h.data_size)
            .ok_or_else(|| Error::format(format!("{name} lies outside the data section")))?;
        if offset < end_of_previous {
            return Err(Error::format(format!("{name} overlaps another tensor")));
        }
        end_of_previous = end;
    }
    Ok(index)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file_with(header: &str, data: &[u8]) -> Vec<u8> {
        let mut v = b"CELLM\x02\0\0".to_vec();
        v.extend_from_slice(&(header.len() as u64).to_le_bytes());
        v.extend_from_slice(header.as_bytes());
        while !v.len().is_multiple_of(ALIGN) {
            v.push(0);
        }
        v.extend_from_slice(data);
        v
    }

    fn parse(bytes: &[u8]) -> Result<CellmFile> {
        CellmFile::from_bytes(bytes)
    }

    const ONE_TENSOR: &str = r#"{"format_version":2,"model":{},"data_size":8,
        "tensors":[{"name":"w","format":"f32","shape":[2],"offset":0,"nbytes":8}]}"#;

    #[test]
    fn reads_a_valid_file() {
        let bytes = file_with(ONE_TENSOR, &[0, 0, 128, 63, 0, 0, 0, 64]);
        let f = parse(&bytes).unwrap();
        assert_eq!(f.tensor("w").unwrap().as_f32().unwrap(), &[1.0, 2.0]);
    }

    #[test]
    fn rejects_truncation_bad_magic_and_bad_sizes() {
        let bytes = file_with(ONE_TENSOR, &[0; 8]);
        assert!(matches!(parse(&bytes[..bytes.len() - 1]), Err(Error::Format(_))));
        assert!(matches!(parse(&bytes[..10]), Err(Error::Format(_))));
        let mut bad = bytes.clone();
        bad[0] = b'X';
        assert!(parse(&bad).is_err());
        let wrong = ONE_TENSOR.replace("\"nbytes\":8", "\"nbytes\":4");
        assert!(parse(&file_with(&wrong, &[0; 8])).is_err());
        let outside = ONE_TENSOR.replace("\"offset\":0", "\"offset\":64");
        assert!(parse(&file_with(&outside, &[0; 8])).is_err());
    }

    #[test]
    fn rejects_version_one_and_unknown_formats() {
        let mut bytes = file_with(ONE_TENSOR, &[0; 8]);
        bytes[5] = 1;
        let e = parse(&bytes).err().unwrap().to_string();
        assert!(e.contains("version 1"), "{e}");
        let q = ONE_TENSOR.replace("\"f32\"", "\"q9_9\"");
        assert!(matches!(parse(&file_with(&q, &[0; 8])), Err(Error::Unsupported(_))));
    }
}
