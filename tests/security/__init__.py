"""Attacks on the gate, as a hostile agent makes them through documented ops."""
