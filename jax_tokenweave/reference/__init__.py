"""Float64 single-device references of the model, for tests and for checking a deployment."""
