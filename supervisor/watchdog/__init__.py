"""The watchdog: observe → detect → decide → act. Detectors and policy are pure."""
