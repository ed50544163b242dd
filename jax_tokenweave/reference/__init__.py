"""Float64 single-device references of the model (``model``), the ground truth the tests compare
with, also for checking a deployment."""
