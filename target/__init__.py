"""draftsmith's floor for the frozen target, under decoding (``infer/``) and training (``train/``) alike: loading,
running and slicing the target (``model``, ``views``), its caches' keywords, its recurrent state and the per-token
routing that keeps a hybrid's verify equal to its own decode, the checks that say whether speculation can be exact
on it, memory estimates and the CPU thread policy."""
