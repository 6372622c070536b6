"""Planning and executing IR graphs; sessions."""
from ember.runtime.executor import Plan
from ember.runtime.ort_compat import InferenceSession
from ember.runtime.session import Session, load

__all__ = ["Plan", "Session", "InferenceSession", "load"]
