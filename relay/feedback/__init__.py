"""Feedback after the 250: late bounces and complaints from providers' webhooks and from
mail sent back to `feedback.address` (see events.py for the one shape they all become)."""
