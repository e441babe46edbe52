//! The lock logic on PostgreSQL: one acquisition's round loop (`acquire`), which keys
//! were found busy lately (`busy`: whether a request tries first), a round's
//! message and how its answer is read (`plan`), the text of every message it sends
//! (`messages`), the hand-over of a lock between this handle's own tasks (`relay`),
//! and the guard's half, on a connection of its own (`held`) or multiplexed (`mux`).

pub(crate) mod acquire;
pub(crate) mod busy;
pub(crate) mod held;
pub(crate) mod messages;
pub(crate) mod mux;
pub(crate) mod plan;
pub(crate) mod relay;
