//! The project's own checks: crate layers, and docs that name only what exists and run as written.

mod doc_blocks;
mod doc_facts;
mod layers;
