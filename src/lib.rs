//! Umbrella package of the sluice workspace: hosts the top-level tests/ and benches/.
