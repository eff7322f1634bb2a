"""Block kinds: a chain, a draft tree, a SPRINTER run and the verifier alone, each one module behind
`block_kind.BlockKind` and registered with `register_kind`; `kinds.kind_of(mode)` finds a session's."""
