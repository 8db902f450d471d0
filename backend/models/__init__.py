"""Model definitions: one decoder stack for every supported family (dense and MoE feed-forwards)."""
