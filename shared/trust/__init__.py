"""Trust: who may write what (the generated NATS authorization, identities) and TLS."""
