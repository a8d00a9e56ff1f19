"""The section models, one module per room of the house (store, inbound, delivery, ops,
feedback, identities); relay/config/models.py is their registry."""
