"""The fleet: replicas on several hosts that follow one elected leader through NATS JetStream."""
