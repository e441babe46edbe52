//! The lock logic on PostgreSQL: the SQL of one acquisition and its release (`plan`),
//! many keys at once (`all`), and the guard's half, on a connection of its own (`held`)
//! or multiplexed (`mux`).

pub(crate) mod all;
pub(crate) mod held;
pub(crate) mod mux;
pub(crate) mod plan;
