"""sdplan: plan and run Stable Diffusion fine-tuning from measurements."""

__version__ = "0.1.0"
