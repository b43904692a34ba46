//! Text <-> token ids, and streaming text out. (Interface placeholder: being written.)
