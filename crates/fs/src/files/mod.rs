//! What an open file's bytes are: the read path of a handle and the write state of a file
//! open for writing (its dirty extents, staging file and streaming upload).

pub mod extents;
pub mod read;
pub mod write;
