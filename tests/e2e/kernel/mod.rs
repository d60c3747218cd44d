//! The netlink suites on the oldest kernel the README claims.

mod min_kernel;
