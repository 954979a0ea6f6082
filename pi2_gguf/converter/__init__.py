"""The offline converter: profiling a model on text, sparsity thresholds, predictors, bundles, synthetic models."""
