//! contextd's pure core: token estimation and counting, the model registry, budget
//! trimming and relevance scoring.
//!
//! Everything here is a pure function or a small value type with no I/O, so it can be
//! tested with `cargo test` alone. The Python bindings live in `python.rs` behind the
//! `python` feature; they only borrow or convert arguments and release the interpreter
//! around large inputs.

pub mod bm25;
pub mod error;
pub mod estimate;
pub mod models;
pub mod relevance;
pub mod specifics;
pub mod text;
pub mod tokens;
pub mod trim;

#[cfg(feature = "python")]
mod python;

pub use bm25::Bm25Index;
pub use error::{CoreError, CoreResult};
pub use estimate::{estimate_tokens, estimate_tokens_chars_div4};
pub use models::{list_models, model_info, ModelInfo};
pub use relevance::{keyword_scores, keyword_select};
pub use specifics::extract_specifics;
pub use text::tokenize;
pub use tokens::{count_tokens, count_tokens_batch, Encoding};
pub use trim::{trim_to_budget, Messages, Role, Trimmed};
