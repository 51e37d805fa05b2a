"""Generate bench/dev_prompts.jsonl, the development prompt set for specpipe.

The set mirrors the six Spec-Bench task categories (mt_bench, translation,
summarization, qa, math_reasoning, rag) with 12 prompts each, in Spec-Bench's
question format: one JSON object per line with ``question_id`` (int),
``category`` (str) and ``turns`` (list of user turns; two for mt_bench, one
elsewhere). It is meant for quick, license-clean local iteration on
acceptance rate and speed without touching the real benchmark.

All chat, translation, QA and math texts below were written for this file.
The summarization and RAG passages are real excerpts of the Python reference
documentation shipped in the stdlib (``pydoc_data.topics``), cut at paragraph
boundaries by (topic, first paragraph, end paragraph) at generation time.
The output is deterministic for a given Python version (the excerpts come
from the running interpreter's docs; generated with CPython 3.11).

Usage:  python bench/make_dev_prompts.py [OUTPUT]   (default: next to this file)
"""

import json
import re
import sys
from pathlib import Path

from pydoc_data.topics import topics

MIN_CHARS, MAX_CHARS = 800, 1500

MT_BENCH = [
    ("Write a short, upbeat announcement (about 150 words) for a neighborhood "
     "library that is launching a tool-lending program, where residents can "
     "borrow drills, ladders and garden equipment.",
     "Now rewrite the announcement as a haiku."),
    ("Compose a polite email to the management of your apartment building "
     "asking them to install bicycle racks in the courtyard. Keep it under "
     "200 words.",
     "Now write the building manager's reply to your email, agreeing to a "
     "three-month trial."),
    ("Pretend you are a lighthouse keeper on a remote island in the 1890s. "
     "Describe a typical evening on the job in the first person.",
     "A storm has just knocked out the lamp. Staying in character, describe "
     "what you do next."),
    ("Act as a friendly museum guide and introduce a group of ten-year-olds "
     "to the skeleton of a woolly mammoth.",
     "One of the children asks why mammoths died out. Answer in character, "
     "at a level they will understand."),
    ("Three friends, Ana, Ben and Chloe, each own exactly one pet: a cat, a "
     "dog or a parrot. Ana is allergic to fur. Ben's pet cannot fly. Chloe "
     "does not own the dog. Who owns which pet? Explain your reasoning.",
     "Now drop the clue about Ana's allergy. How many assignments of pets "
     "are still consistent with the remaining clues? List them."),
    ("Is the following argument logically valid? 'All squares are "
     "rectangles. Some rectangles are not rhombuses. Therefore, some squares "
     "are not rhombuses.' Explain why or why not.",
     "Give a different argument with the same logical form whose premises "
     "are clearly true but whose conclusion is clearly false."),
    ("Write a Python function that takes a list of integers and returns the "
     "length of the longest strictly increasing run of consecutive elements. "
     "Include a few test cases.",
     "Modify your function so that it also returns the start index of that "
     "run, and state its time and space complexity."),
    ("Explain the difference between a shallow copy and a deep copy in "
     "Python, with a short code example where the two behave differently.",
     "Summarize your answer in two sentences."),
    ("Explain to a high school student how a refrigerator moves heat from "
     "its cold interior into the warmer kitchen.",
     "Using your explanation, explain why leaving the refrigerator door open "
     "will not cool down the kitchen."),
    ("Compare mitosis and meiosis. Organize your answer as a table with one "
     "row per property.",
     "Write a short mnemonic that would help a student remember the most "
     "important differences from your table."),
    ("In about 250 words, discuss the main factors that historians connect "
     "with the decline of the Western Roman Empire.",
     "Which of the factors you mentioned is the most debated among "
     "historians, and why? Answer in one paragraph."),
    ("Extract all dates, people and places from the text below and return "
     "them as JSON with the keys \"dates\", \"people\" and \"places\".\n\n"
     "On 14 March 2021, Priya Raman flew from Chennai to Lisbon to meet her "
     "co-author Tomas Eriksen. The two spent a week at a small guesthouse in "
     "Sintra finishing their book, and on 22 March they presented a draft at "
     "a workshop in Porto.",
     "Now write a one-sentence summary of the text that mentions only the "
     "people and the last place they visited."),
]

TRANSLATION = [
    ("German", "Der Zug nach Hamburg hatte heute Morgen zwanzig Minuten "
     "Verspätung, weil ein Baum auf die Gleise gefallen war. Viele Pendler "
     "kamen deshalb zu spät zur Arbeit."),
    ("German", "Meine Großmutter backt jeden Sonntag einen Apfelkuchen nach "
     "einem alten Familienrezept. Niemand weiß genau, welches Gewürz sie "
     "heimlich hinzufügt."),
    ("German", "Die Stadtverwaltung plant, im nächsten Frühjahr mehr Radwege "
     "zu bauen und die Innenstadt teilweise für Autos zu sperren."),
    ("German", "Wenn du morgen Zeit hast, könnten wir zusammen ins Museum "
     "gehen. Die neue Ausstellung über Vulkane soll sehr spannend sein. Ich "
     "kaufe die Karten online."),
    ("French", "Le marché du samedi attire des gens de tous les villages "
     "voisins. On y trouve des fromages, du miel et des légumes cultivés "
     "sans pesticides."),
    ("French", "Après trois jours de pluie, le soleil est enfin revenu et "
     "les enfants ont pu jouer dans le jardin."),
    ("French", "Notre équipe a terminé le projet avec une semaine d'avance, "
     "mais le client a demandé plusieurs modifications de dernière minute. "
     "Nous devrons donc travailler ce week-end."),
    ("French", "Je n'ai jamais compris pourquoi mon chat préfère dormir dans "
     "une boîte en carton plutôt que dans son panier tout neuf."),
    ("Spanish", "La biblioteca municipal abrirá hasta la medianoche durante "
     "la época de exámenes. Los estudiantes podrán reservar salas de estudio "
     "en línea."),
    ("Spanish", "Mi hermano aprendió a tocar la guitarra viendo vídeos en "
     "internet, y ahora toca con un pequeño grupo los fines de semana."),
    ("Spanish", "El médico me recomendó caminar al menos treinta minutos al "
     "día y beber más agua. Dice que así dormiré mejor."),
    ("Spanish", "Aunque el restaurante estaba lleno, el camarero nos encontró "
     "una mesa junto a la ventana. La comida llegó rápido y estaba "
     "deliciosa."),
]

QA = [
    "Why is the sky blue during the day but often red or orange at sunset?",
    "How do vaccines train the immune system to recognize a pathogen?",
    "What is the difference between weather and climate?",
    "Why do ice cubes float in water?",
    "Who was Ada Lovelace, and why is she remembered in the history of "
    "computing?",
    "What is inflation, and how do central banks try to keep it under "
    "control?",
    "How does a rainbow form?",
    "What is the role of mitochondria in a cell?",
    "Why does the Moon always show the same face to the Earth?",
    "Why was Gutenberg's printing press so important for European history?",
    "What is the difference between a virus and a bacterium?",
    "How do noise-cancelling headphones work?",
]

MATH = [
    "A bakery sells muffins for $3 each and cookies for $1.50 each. On "
    "Saturday it sold 48 muffins and twice as many cookies. How much money "
    "did the bakery make from muffins and cookies on Saturday?",
    "Lena reads 18 pages of her book on every weekday and 30 pages on each "
    "day of the weekend. The book has 384 pages. If she starts reading on a "
    "Monday, on which day of the week will she finish it?",
    "A school is taking 214 students and 17 teachers on a field trip. Each "
    "bus holds 45 people. How many buses are needed, and how many seats will "
    "be left empty?",
    "A jacket was priced at $80. The store took 25% off, and Marco then used "
    "a coupon for another $6 off the discounted price. How much did Marco "
    "pay for the jacket?",
    "A water tank holds 1,200 liters and is one-quarter full. A pump adds 35 "
    "liters per minute, while a leak drains 5 liters per minute. How many "
    "minutes will it take to fill the tank?",
    "Sam is 4 times as old as his daughter. In 20 years he will be twice as "
    "old as she will be then. How old are Sam and his daughter now?",
    "A rectangular garden is 12 meters long and 7 meters wide. A path 1 "
    "meter wide runs around the outside of the garden. What is the area of "
    "the path?",
    "Priya earns $18 per hour for the first 40 hours she works in a week "
    "and 1.5 times that rate for every extra hour. Last week she worked 46 "
    "hours. How much did she earn?",
    "A box holds red, blue and green marbles in the ratio 3:5:2. There are "
    "60 marbles in total. How many more blue marbles than red marbles are "
    "there?",
    "Tom drives 150 km at 60 km/h and then another 150 km at 100 km/h. What "
    "is his average speed for the whole trip?",
    "A recipe uses 250 grams of flour for 10 pancakes. Jana wants to make 36 "
    "pancakes using flour from a single 1-kilogram bag. How many grams of "
    "flour will be left in the bag?",
    "A library had 2,450 books. In January it bought 120 new books and "
    "threw away 35 damaged ones. In February it received 80 donated books "
    "and lent out 310 books, of which 260 were returned by the end of the "
    "month. How many books were on the shelves at the end of February?",
]

# (pydoc topic, first paragraph, end paragraph); paragraph indices count
# non-heading paragraphs of the topic text.
SUMMARIZATION = [
    ("exceptions", 0, 4), ("objects", 0, 4), ("execmodel", 0, 2),
    ("import", 5, 10), ("class", 2, 8), ("raise", 1, 6),
    ("typesmodules", 0, 3), ("comparisons", 0, 6), ("dict", 2, 8),
    ("function", 2, 9), ("try", 3, 6), ("strings", 3, 7),
]

# (pydoc topic, first paragraph, end paragraph, question)
RAG = [
    ("assert", 0, 8, "What value does __debug__ have when Python is run "
     "with the -O option, and what code is generated for assert statements "
     "in that case?"),
    ("global", 1, 6, "Does a global statement inside a string passed to "
     "exec() affect the code block that calls exec()?"),
    ("for", 0, 4, "If the body of a for loop executes a break statement, "
     "is the loop's else clause run?"),
    ("booleans", 1, 6, "What does the expression s or 'foo' evaluate to "
     "when s is an empty string, and why?"),
    ("context-managers", 3, 9, "How can an __exit__() method prevent an "
     "exception raised inside the with block from propagating?"),
    ("augassign", 3, 7, "In the statement a[i] += f(x), in what order are "
     "a[i] and f(x) evaluated?"),
    ("return", 1, 7, "What happens when a generator function executes a "
     "return statement with a value?"),
    ("power", 0, 7, "What is the result of -1**2 in Python, and what "
     "happens if you raise 0.0 to a negative power?"),
    ("in", 1, 6, "How is x in y evaluated for a user-defined class that "
     "defines __iter__() but not __contains__()?"),
    ("truth", 0, 6, "Which kinds of built-in objects are considered false "
     "when tested for truth value?"),
    ("del", 1, 6, "What happens if you delete a name that is not bound?"),
    ("id-classes", 0, 7, "Where does the interactive interpreter store the "
     "result of the last evaluation?"),
]


def paragraphs(topic):
    """Blank-line separated paragraphs of a pydoc topic, minus section headings."""
    text = "\n".join(line.rstrip() for line in topics[topic].splitlines())
    paras = [p.strip("\n") for p in re.split(r"\n\s*\n", text) if p.strip()]
    return [p for p in paras if not re.search(r"\n[*=-]{3,}$", p)]


def excerpt(topic, start, end):
    text = "\n\n".join(paragraphs(topic)[start:end])
    assert MIN_CHARS <= len(text) <= MAX_CHARS, (topic, len(text))
    return text


def sentence_word(text):
    return "sentence" if len(re.findall(r"[.!?](?:\s|$)", text)) == 1 else "sentences"


def build():
    rows = []

    def add(category, *turns):
        rows.append({"question_id": len(rows) + 1, "category": category,
                     "turns": list(turns)})

    for first, second in MT_BENCH:
        add("mt_bench", first, second)
    for lang, text in TRANSLATION:
        add("translation", f"Translate the following {lang} {sentence_word(text)} "
                           f"to English: {text}")
    for topic, start, end in SUMMARIZATION:
        add("summarization", "Summarize the following passage from the Python "
                             "documentation in a few sentences:\n\n"
                             + excerpt(topic, start, end))
    for question in QA:
        add("qa", question)
    for problem in MATH:
        add("math_reasoning", problem + " Solve the problem step by step and "
                              "give the final answer at the end.")
    for topic, start, end, question in RAG:
        add("rag", "Answer the question using the context.\n\nContext:\n"
                   + excerpt(topic, start, end) + f"\n\nQuestion: {question}")
    return rows


def main():
    default = Path(__file__).with_name("dev_prompts.jsonl")
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else default
    rows = build()
    with open(out, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    print(f"wrote {len(rows)} prompts to {out}")


if __name__ == "__main__":
    main()
