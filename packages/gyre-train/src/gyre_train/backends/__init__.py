"""Training backends: the protocol (base) and its torch implementation (the Megatron one lives in gyre_train.megatron)."""
