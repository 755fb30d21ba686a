"""The node's model cache: a model is made present before its engine starts (spec 002,
"模型缓存 Ensure"). `ensure.ModelEnsurer` is what the executor calls; `store` keeps the
cache's entries, its budget and its least-recently-used eviction; `fetch` downloads a
hub model from the operator's mirror (resumed, checksummed); `progress` throttles what
the control plane is told while it does."""
