"""Fifty different JSON schemas (with a request in words for each) for constrained-output checks: strings
with length limits and patterns, enums, consts, integers and numbers with ranges, booleans, arrays with item
limits, nested objects, optional fields, anyOf and nullable values. Used by benchmarks/json_schemas.py and
tests/test_json_schemas.py."""

from __future__ import annotations

from typing import Any


def s(n: int = 30, **kw: Any) -> dict[str, Any]:
    return {"type": "string", "maxLength": n, **kw}


def i(lo: int = 0, hi: int = 1000) -> dict[str, Any]:
    return {"type": "integer", "minimum": lo, "maximum": hi}


def f(lo: float = 0.0, hi: float = 1000.0) -> dict[str, Any]:
    return {"type": "number", "minimum": lo, "maximum": hi}


def e(*values: Any) -> dict[str, Any]:
    return {"enum": list(values)}


def a(item: dict[str, Any], most: int = 3, least: int = 0) -> dict[str, Any]:
    return {"type": "array", "items": item, "minItems": least, "maxItems": most}


def o(props: dict[str, Any], optional: tuple[str, ...] = ()) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": [k for k in props if k not in optional],
            "additionalProperties": False}


B = {"type": "boolean"}

CASES: list[tuple[str, dict[str, Any]]] = [
    ("a person", o({"name": s(), "age": i(0, 120)})),
    ("a book", o({"title": s(40), "author": s(), "year": i(1400, 2030)})),
    ("a city", o({"city": s(), "country": s(), "population": i(0, 40_000_000)})),
    ("a product in a shop", o({"product": s(), "price": f(0, 10_000), "in_stock": B})),
    ("a pet", o({"name": s(20), "species": e("cat", "dog", "bird", "fish"), "age": i(0, 40)})),
    ("a movie", o({"title": s(40), "genre": e("drama", "comedy", "action", "horror", "documentary"),
                   "rating": f(0, 10)})),
    ("a weather report", o({"city": s(), "temperature_c": f(-60, 60), "sky": e("sunny", "cloudy", "rainy")})),
    ("a todo list with a few items", o({"items": a(s(40), 4, 1)})),
    ("a recipe", o({"dish": s(), "ingredients": a(s(25), 4, 1), "minutes": i(1, 600)})),
    ("a color in RGB", o({"name": s(20), "r": i(0, 255), "g": i(0, 255), "b": i(0, 255)})),
    ("a point in 3D", o({"x": f(-100, 100), "y": f(-100, 100), "z": f(-100, 100)})),
    ("a yes or no answer to: is the earth round?", o({"answer": B})),
    ("a student's grades", o({"student": s(), "grades": a(i(0, 100), 4, 1)})),
    ("an email address record", o({"user": s(20), "email": s(40, pattern=r"^[a-z]+@[a-z]+\.[a-z]{2,3}$")})),
    ("a phone contact", o({"name": s(), "phone": {"type": "string", "pattern": r"^[0-9]{3}-[0-9]{4}$"}})),
    ("a calendar date", o({"year": i(1900, 2100), "month": i(1, 12), "day": i(1, 31)})),
    ("a time of day", o({"hour": i(0, 23), "minute": i(0, 59)})),
    ("a car", o({"make": s(20), "model": s(20), "year": i(1950, 2030), "electric": B})),
    ("a country with its capital and languages", o({"country": s(), "capital": s(), "languages": a(s(20), 3, 1)})),
    ("a song", o({"title": s(40), "artist": s(), "seconds": i(10, 1200)})),
    ("a bank transaction", o({"amount": f(-100000, 100000), "currency": e("USD", "EUR", "GBP", "JPY"),
                              "note": s(40)})),
    ("a user profile with an optional nickname", o({"username": s(20), "nickname": s(20), "verified": B},
                                                   optional=("nickname",))),
    ("a team of people", o({"team": s(), "members": a(o({"name": s(20), "role": s(20)}), 3, 1)})),
    ("an address", o({"street": s(40), "city": s(), "zip": {"type": "string", "pattern": r"^[0-9]{5}$"}})),
    ("a chess move", o({"piece": e("king", "queen", "rook", "bishop", "knight", "pawn"),
                        "from": {"type": "string", "pattern": r"^[a-h][1-8]$"},
                        "to": {"type": "string", "pattern": r"^[a-h][1-8]$"}})),
    ("a planet", o({"name": s(20), "moons": i(0, 200), "has_rings": B})),
    ("a server status", o({"status": e("ok", "degraded", "down"), "uptime_hours": f(0, 100000)})),
    ("a log entry", o({"level": e("debug", "info", "warning", "error"), "message": s(60)})),
    ("a rectangle", o({"width": f(0, 1000), "height": f(0, 1000)})),
    ("a version number", o({"major": i(0, 99), "minor": i(0, 99), "patch": i(0, 999)})),
    ("a sports match result", o({"home": s(20), "away": s(20), "home_goals": i(0, 20), "away_goals": i(0, 20)})),
    ("a list of three prime numbers", o({"primes": a(i(2, 1000), 3, 3)})),
    ("a flight", o({"flight": {"type": "string", "pattern": r"^[A-Z]{2}[0-9]{3,4}$"}, "from": s(20), "to": s(20)})),
    ("a hotel booking", o({"hotel": s(), "nights": i(1, 60), "breakfast": B, "guests": i(1, 8)})),
    ("a tweet", o({"text": s(80), "likes": i(0, 1000000), "hashtags": a(s(20), 3)})),
    ("a geographic coordinate", o({"lat": f(-90, 90), "lon": f(-180, 180)})),
    ("a sentiment classification of 'I love it'", o({"sentiment": e("positive", "negative", "neutral"),
                                                     "confidence": f(0, 1)})),
    ("a translation of hello into French", o({"source": s(20), "target": s(20), "language": e("fr", "de", "es")})),
    ("a shopping cart", o({"items": a(o({"name": s(20), "qty": i(1, 20)}), 3, 1), "total": f(0, 100000)})),
    ("an API error", o({"error": o({"code": i(100, 599), "message": s(50)})})),
    ("a measurement that may be missing", o({"sensor": s(20), "value": {"anyOf": [f(-1000, 1000), {"type": "null"}]}})),
    ("an identifier that is a number or a short code", o({"id": {"anyOf": [i(0, 100000), s(8)]}})),
    ("a fixed-kind record", o({"kind": {"const": "invoice"}, "number": i(1, 99999), "paid": B})),
    ("a tree node with children names", o({"node": s(20), "children": a(s(20), 3)})),
    ("a painting", o({"title": s(40), "artist": s(), "year": i(1000, 2030), "museum": s(40)}, optional=("museum",))),
    ("a programming language", o({"name": s(20), "typed": e("static", "dynamic"), "year": i(1950, 2030)})),
    ("a workout", o({"exercise": s(20), "sets": i(1, 10), "reps": i(1, 100), "weight_kg": f(0, 500)})),
    ("a menu with two dishes", o({"restaurant": s(), "dishes": a(o({"dish": s(25), "price": f(0, 500)}), 2, 2)})),
    ("a meeting", o({"topic": s(40), "attendees": a(s(20), 4, 1), "minutes": i(5, 480), "online": B})),
    ("an animal fact sheet", o({"animal": s(20), "legs": i(0, 1000), "habitat": e("land", "sea", "air"),
                                "endangered": B})),
]
