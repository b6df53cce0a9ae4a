//! The model registry: context window, output reserve and tokenizer per model.
//!
//! The data lives in `data/models.toml` (documented there) and is compiled into the
//! binary, so the service needs no config file to know a model, and a malformed entry
//! fails `cargo test` (see `registry_parses_and_is_consistent`) instead of a request.

use std::collections::BTreeMap;
use std::sync::LazyLock;

use serde::Deserialize;

use crate::error::{CoreError, CoreResult};
use crate::tokens::Encoding;

/// The registry's source text, as shipped.
pub const MODELS_TOML: &str = include_str!("../data/models.toml");

/// What contextd needs to know about one model to budget a context for it.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelInfo {
    /// Registry name this entry is filed under (a dated id resolves to its base name).
    pub name: String,
    /// Total tokens the model accepts, prompt plus output.
    pub context_window: u64,
    /// Most output tokens one response may have.
    pub max_output: u64,
    /// Tokens kept free for the answer by default (at most `max_output`).
    pub output_reserve: u64,
    /// How to count this model's tokens.
    pub tokenizer: Encoding,
    /// Safety multiplier on counts, in thousandths (1300 = x1.3). Integer so that budgets
    /// are exact: `100 * 1.3` in floating point is 130.00000000000003 and would round up.
    pub margin_milli: u64,
}

impl ModelInfo {
    /// The margin as a float, for display.
    pub fn margin(&self) -> f64 {
        self.margin_milli as f64 / 1000.0
    }

    /// Tokens available for the prompt when `output_reserve` tokens are kept for the answer.
    pub fn prompt_budget(&self) -> u64 {
        self.context_window.saturating_sub(self.output_reserve)
    }

    /// A raw tokenizer count scaled by the margin, rounded up: what the count costs
    /// against this model's window. Saturates at `u64::MAX`; the product is taken in
    /// `u128`, since saturating it before dividing would make a huge count cost less.
    pub fn apply_margin(&self, count: u64) -> u64 {
        let scaled = (u128::from(count) * u128::from(self.margin_milli)).div_ceil(1000);
        u64::try_from(scaled).unwrap_or(u64::MAX)
    }

    /// Budget cost of each text for this model: its tokenizer's count times the margin.
    pub fn count_batch<S: AsRef<str> + Sync>(&self, texts: &[S]) -> Vec<u64> {
        let mut counts = self.tokenizer.count_batch(texts);
        for c in &mut counts {
            *c = self.apply_margin(*c);
        }
        counts
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawFile {
    models: BTreeMap<String, RawModel>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawModel {
    context_window: u64,
    max_output: u64,
    output_reserve: u64,
    tokenizer: String,
    margin: f64,
}

/// A parsed, validated registry.
#[derive(Debug, Clone)]
pub struct Registry {
    models: BTreeMap<String, ModelInfo>,
}

impl Registry {
    /// Parse and validate a registry file.
    pub fn parse(source: &str) -> CoreResult<Self> {
        let raw: RawFile = toml::from_str(source)
            .map_err(|e| CoreError::InvalidArgument(format!("model registry: {e}")))?;
        let mut models = BTreeMap::new();
        for (name, m) in raw.models {
            let bad = |what: &str| CoreError::InvalidArgument(format!("model {name:?}: {what}"));
            if name != name.to_lowercase() {
                return Err(bad(
                    "names must be lower case (lookups are case-insensitive)",
                ));
            }
            let tokenizer: Encoding = m.tokenizer.parse()?;
            if !(1.0..=4.0).contains(&m.margin) {
                return Err(bad("margin must be between 1.0 and 4.0"));
            }
            if m.output_reserve > m.max_output || m.max_output > m.context_window {
                return Err(bad("need output_reserve <= max_output <= context_window"));
            }
            if m.output_reserve >= m.context_window {
                return Err(bad("output_reserve leaves no room for a prompt"));
            }
            let info = ModelInfo {
                name: name.clone(),
                context_window: m.context_window,
                max_output: m.max_output,
                output_reserve: m.output_reserve,
                tokenizer,
                margin_milli: (m.margin * 1000.0).round() as u64,
            };
            models.insert(name, info);
        }
        if !models.contains_key("default") {
            return Err(CoreError::InvalidArgument(
                "model registry: a \"default\" entry is required".into(),
            ));
        }
        Ok(Registry { models })
    }

    /// All registry names, sorted.
    pub fn names(&self) -> Vec<&str> {
        self.models.keys().map(String::as_str).collect()
    }

    /// Look a model up: exact name, else the longest entry that is a `-`-separated prefix
    /// (dated snapshots such as `claude-sonnet-4-5-20250929`). Case-insensitive; a leading
    /// `provider/` is ignored.
    pub fn get(&self, model: &str) -> CoreResult<&ModelInfo> {
        let lowered = model.trim().to_lowercase();
        let id = lowered.rsplit('/').next().unwrap_or_default();
        if let Some(info) = self.models.get(id) {
            return Ok(info);
        }
        // Walk back over '-' boundaries, longest prefix first.
        let mut end = id.len();
        while let Some(cut) = id[..end].rfind('-') {
            if let Some(info) = self.models.get(&id[..cut]) {
                return Ok(info);
            }
            end = cut;
        }
        Err(CoreError::UnknownModel(model.to_owned()))
    }
}

static REGISTRY: LazyLock<Registry> = LazyLock::new(|| {
    // Cannot fail in a released build: `registry_parses_and_is_consistent` parses it.
    Registry::parse(MODELS_TOML).expect("data/models.toml is validated by cargo test")
});

/// The built-in registry.
pub fn registry() -> &'static Registry {
    &REGISTRY
}

/// Look up a model in the built-in registry (see [`Registry::get`]).
pub fn model_info(model: &str) -> CoreResult<&'static ModelInfo> {
    registry().get(model)
}

/// Names in the built-in registry, sorted.
pub fn list_models() -> Vec<&'static str> {
    registry().names()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registry_parses_and_is_consistent() {
        let reg = Registry::parse(MODELS_TOML).unwrap();
        for required in [
            "default",
            "gpt-4o",
            "gpt-4o-mini",
            "gpt-4.1",
            "o3",
            "gpt-5",
            "claude-sonnet-4-5",
            "claude-opus-4-1",
            "claude-haiku-4-5",
            "claude-3-5-haiku",
        ] {
            assert!(reg.models.contains_key(required), "{required} missing");
        }
        for info in reg.models.values() {
            if info.tokenizer.is_exact() && info.name.starts_with("claude") {
                assert!(info.margin_milli > 1000, "{} needs a margin", info.name);
            }
            if info.name.starts_with("gpt") || info.name.starts_with('o') {
                assert_eq!(info.margin_milli, 1000, "{} is exact", info.name);
            }
        }
    }

    #[test]
    fn dated_ids_resolve_to_the_longest_prefix() {
        assert_eq!(
            model_info("claude-sonnet-4-5-20250929").unwrap().name,
            "claude-sonnet-4-5"
        );
        assert_eq!(model_info("gpt-4o-2024-08-06").unwrap().name, "gpt-4o");
        assert_eq!(
            model_info("gpt-4o-mini-2024-07-18").unwrap().name,
            "gpt-4o-mini"
        );
        assert_eq!(model_info("gpt-5-chat-latest").unwrap().name, "gpt-5-chat");
        assert_eq!(model_info("o3-mini-2025-01-31").unwrap().name, "o3-mini");
        assert_eq!(
            model_info("claude-3-5-haiku-latest").unwrap().name,
            "claude-3-5-haiku"
        );
        assert_eq!(model_info("openai/GPT-4.1").unwrap().name, "gpt-4.1");
    }

    #[test]
    fn unknown_models_are_errors_not_defaults() {
        assert_eq!(
            model_info("llama-3"),
            Err(CoreError::UnknownModel("llama-3".into()))
        );
        // A prefix must end at a '-' boundary: "gpt-4ox" is not "gpt-4".
        assert!(model_info("gpt-4ox").is_err());
        assert!(model_info("").is_err());
    }

    #[test]
    fn margin_is_exact_integer_arithmetic() {
        let claude = model_info("claude-sonnet-4-5").unwrap();
        assert_eq!(claude.margin(), 1.3);
        assert_eq!(claude.apply_margin(100), 130);
        assert_eq!(claude.apply_margin(101), 132); // 131.3 rounds up
        let gpt = model_info("gpt-4o").unwrap();
        assert_eq!(gpt.apply_margin(12345), 12345);
        assert_eq!(gpt.prompt_budget(), 128000 - 16384);
    }

    #[test]
    fn huge_counts_cost_at_least_themselves() {
        // The product saturated before the division: u64::MAX cost u64::MAX / 1000.
        for name in ["gpt-4o", "claude-sonnet-4-5", "default"] {
            let info = model_info(name).unwrap();
            for count in [u64::MAX, u64::MAX / 2, 1 << 60, u64::MAX / 1000 + 1] {
                let cost = info.apply_margin(count);
                assert!(cost >= count, "{name} {count}: {cost}");
                let exact = (u128::from(count) * u128::from(info.margin_milli)).div_ceil(1000);
                assert_eq!(u128::from(cost), exact.min(u128::from(u64::MAX)), "{name}");
            }
        }
        let claude = model_info("claude-sonnet-4-5").unwrap();
        assert_eq!(
            claude.apply_margin(1 << 60),
            ((1u128 << 60) * 13).div_ceil(10) as u64
        );
        assert_eq!(claude.apply_margin(u64::MAX), u64::MAX);
    }

    #[test]
    fn bad_registries_are_rejected() {
        let ok = "[models.default]\ncontext_window=10\nmax_output=5\noutput_reserve=1\ntokenizer=\"estimate\"\nmargin=1.0\n";
        assert!(Registry::parse(ok).is_ok());
        assert!(Registry::parse(&ok.replace("estimate", "p50k")).is_err());
        assert!(Registry::parse(&ok.replace("margin=1.0", "margin=0.5")).is_err());
        assert!(Registry::parse(&ok.replace("max_output=5", "max_output=50")).is_err());
        assert!(Registry::parse(&ok.replace("default", "Default")).is_err());
        assert!(Registry::parse(&format!("{ok}extra=1\n")).is_err());
    }
}
