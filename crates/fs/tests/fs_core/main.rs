//! The fs core driven in-process against the memory store (and the fault store for errors),
//! one module per area over the shared harness in `tests/support`. One test binary.

#[path = "../support/mod.rs"]
mod support;

mod attributes;
mod background;
mod directories;
mod failures;
mod memory;
mod read;
mod rename;
mod unlink;
mod write;
