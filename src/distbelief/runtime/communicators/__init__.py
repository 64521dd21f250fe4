"""How the ranks are laid out and talk: roles and communicators (topology), nodes,
shard placement, and polled collectives that never block on a dead rank (agreement)."""
