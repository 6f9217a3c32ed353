"""The bundled trainer: one recipe per method on diffusers + accelerate (installed as sdplan.trainer)."""
