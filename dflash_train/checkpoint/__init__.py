"""Drafter folders on disk: our training format, and the Speculators and native DFlash formats."""
