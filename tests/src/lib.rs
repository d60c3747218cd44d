//! tether end-to-end harness.
